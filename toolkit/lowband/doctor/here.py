"""This machine, for a run: what `lowband doctor` checks before any other machine is asked.

Each check is (level, sentence): "ok", "note" (the run works, but know this) or "fail" (it
will not, and the sentence says what to do). The software (Python, torch, the backends, CUDA
and NCCL where there is a GPU, lowband's extras as its package metadata lists them), the
resources (the config's ranks and memory against this machine's, as `lowband train` asks
before it starts workers: launch/fits.py; free disk where the runs go), and the network (the
interfaces, and which address lowband would bind: comm/membership/bind.py).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import shutil
import socket
from pathlib import Path

from lowband.comm.membership.bind import (LOOPBACK, bind_host, interface_of, interfaces,
                                          is_loopback)
from lowband.config import Config, ConfigError
from lowband.launch.fits import GB, available_bytes, refusals, worker_bytes
from lowband.options import BIND_ENV

Check = tuple[str, str]


def software() -> list[Check]:
    import torch
    import torch.distributed as dist

    out = [("ok", f"torch {torch.__version__} on Python {platform.python_version()} "
                  f"({platform.system()} {platform.machine()})")]
    if not dist.is_available() or not dist.is_gloo_available():
        out.append(("fail", "this torch has no gloo backend, which every outer exchange uses: "
                            "install a torch build with torch.distributed (the pip wheels)."))
    else:
        out.append(("ok", "torch.distributed with gloo"))
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        free = [torch.cuda.mem_get_info(i)[0] / GB for i in range(len(names))]
        nccl = (".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available()
                else None)
        out.append(("ok", f"CUDA {torch.version.cuda}: {len(names)} device(s), "
                          + ", ".join(f"{n} ({f:.0f} GB free)" for n, f in zip(names, free))))
        out.append(("ok", f"NCCL {nccl}") if nccl else
                   ("note", "no NCCL in this torch: the inner groups use gloo on the GPU."))
    else:
        out.append(("ok", "no CUDA device: lowband trains on the CPU"))
    return out + extras()


def extras() -> list[Check]:
    """Which of lowband's extras are installed, as its package metadata lists them."""
    try:
        meta = importlib.metadata.metadata("lowband")
    except importlib.metadata.PackageNotFoundError:
        return [("note", "lowband's package metadata is missing (not pip-installed): its "
                         "extras are not checked.")]
    needs: dict[str, list[str]] = {}
    for req in meta.get_all("Requires-Dist") or []:
        found = re.search(r'extra == "([^"]+)"', req)
        name = re.match(r"[A-Za-z0-9_.-]+", req).group(0)
        if found and name != "lowband":  # an extra of extras (user, all) is its parts
            needs.setdefault(found.group(1), []).append(name)

    def installed(dist_name: str) -> bool:
        try:
            importlib.metadata.version(dist_name)
            return True
        except importlib.metadata.PackageNotFoundError:
            return False

    have = [e for e, names in needs.items() if all(map(installed, names))]
    missing = [e for e in needs if e not in have and e != "test"]
    out = [("ok", f"extras installed: {', '.join(have) or 'none'}")]
    if missing:
        out.append(("note", f"extras not installed: {', '.join(missing)} (pip install "
                            "'lowband[NAME]'; a command that needs one names it)."))
    return out


def resources(cfg: Config, ranks: int) -> list[Check]:
    """The config's `ranks` on this machine: cores and memory (launch/fits.py), and disk."""
    from lowband.comm.topology import pick_device

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    available = available_bytes()
    refused, noted = refusals(cfg, ranks, cores or 1, available,
                              on_cpu=pick_device(cfg.device).type == "cpu")
    memory = "unknown" if available is None else f"{available / GB:.1f} GB"
    out = [("ok", f"{cores} cores, {memory} of memory available, for {ranks} rank(s) of "
                  f"--model {cfg.model}")]
    out += [("fail", s) for s in refused] + [("note", s) for s in noted]
    runs = Path(cfg.run_dir).parent if cfg.run_dir else Path("runs")
    where = next((p for p in (runs, *runs.resolve().parents) if p.exists()), Path("."))
    free = shutil.disk_usage(where).free
    model, _ = worker_bytes(cfg)  # a checkpoint holds about what a worker's model does
    need = model * cfg.replicas
    level = "fail" if free < need else "ok"
    out.append((level, f"{free / GB:.1f} GB free where runs go ({where})" + (
        f": a checkpoint of this config needs about {need / GB:.1f} GB; free some, or give "
        "--run-dir on a larger disk." if level == "fail" else "")))
    return out


def network(peer: str | None) -> tuple[list[Check], str | None]:
    """The interfaces, and the address lowband binds (--bind, $LOWBAND_BIND_HOST, else the one
    that routes to `peer`, the rendezvous host; loopback for a run on this machine)."""
    shown = ", ".join(f"{name} {' '.join(addrs)}" for name, addrs in interfaces().items() if addrs)
    out = [("ok", f"interfaces: {shown}")]
    try:
        address = bind_host(peer)
    except ConfigError as e:
        return out + [("fail", str(e))], None
    how = (f"--bind ({os.environ[BIND_ENV]})" if os.environ.get(BIND_ENV) else
           f"the interface that routes to {peer}" if peer else "a run on this machine")
    out.append(("ok", f"lowband binds {address} ({interface_of(address) or 'a secondary address'}"
                      f"; {how}), never every interface"))
    name = socket.gethostname()
    try:
        first = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError:
        first = None
    if peer and not is_loopback(peer) and address != LOOPBACK:
        if first is None:
            out.append(("note", f"this machine's name '{name}' does not resolve here: other "
                                "nodes reach it by address only."))
        elif first != address:
            out.append(("note", f"this machine's name '{name}' resolves to {first}, not to the "
                                f"address lowband binds ({address}): a node that reaches it by "
                                "name goes elsewhere (the checks across nodes say whether one "
                                "does)."))
    return out, address
