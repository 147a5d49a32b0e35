"""Bind only what is needed (comm/membership/bind.py): every listening socket of a one-machine run is on
loopback, elastic (the Lighthouse, torchft's servers, the stores, gloo) or not; a launched job's
--bind (the TorchX component's bind) reaches every role and is refused, in one sentence, when
it is no interface or address of the machine, or every interface."""

import ipaddress
import os
import socket
import struct
import subprocess
import sys
import time

import pytest

import lowband
from lowband.comm.membership.bind import BIND_ENV, RANK0_ENV, bind_host, check_bind, interfaces, resolve
from lowband.config import ConfigError

SMALL = ["--model", "nano", "--seq-len", 32, "--batch-size", 4, "--eval-every", 0,
         "--eval-batches", 1, "--no-progress", "--link-bandwidth", "none", "--steps", 8,
         "--sync-every", 4]


def listening(root: int) -> dict[str, int]:
    """The listening TCP sockets of process `root` and its descendants: address -> pid."""
    pids, todo = set(), [root]
    while todo:
        pid = todo.pop()
        pids.add(pid)
        for task in _entries(f"/proc/{pid}/task"):
            try:
                todo += [int(c) for c in open(f"/proc/{pid}/task/{task}/children").read().split()]
            except OSError:
                pass
    owner = {}
    for pid in pids:
        for fd in _entries(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                owner[int(link[8:-1])] = pid
    out = {}
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for row in open(f"/proc/net/{table}").read().splitlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and int(cols[9]) in owner:  # 0A: LISTEN
                ip, port = cols[1].split(":")
                raw = bytes.fromhex(ip)  # the kernel's words, each in host (little-endian) order
                raw = b"".join(struct.pack("<I", w) for w in struct.unpack(f">{len(raw) // 4}I", raw))
                out[f"{socket.inet_ntop(family, raw)}:{int(port, 16)}"] = owner[int(cols[9])]
    return out


def _entries(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


@pytest.mark.parametrize("mode", ["elastic", "plain"])
@pytest.mark.slow
def test_a_one_machine_run_listens_on_loopback_only(tmp_path, mode):
    if mode == "elastic":
        pytest.importorskip("torchft")
    args = ["--algo", "streaming", "--fragments", 2, "--replicas", 2, *SMALL,
            *(["--elastic"] if mode == "elastic" else [])]
    proc = subprocess.Popen([sys.executable, "-m", "lowband.cli", "train", "--run-dir",
                             tmp_path / "run", *map(str, args)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen, deadline = {}, time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        seen.update(listening(proc.pid))
        time.sleep(0.05)
    out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out
    wide = [a for a in seen if not ipaddress.ip_address(a.rsplit(":", 1)[0]).is_loopback]
    assert not wide, f"listening beyond loopback: {wide} (all: {seen})"
    # the launcher's Lighthouse (elastic) and every worker listened: stores, gloo, torchft
    assert len(set(seen.values())) >= (3 if mode == "elastic" else 2), seen
    assert len(seen) >= (9 if mode == "elastic" else 5), seen


def test_bind_host_follows_the_variable_else_the_route_else_loopback(monkeypatch):
    for var in (BIND_ENV, "TORCHFT_LIGHTHOUSE", "MASTER_ADDR", RANK0_ENV):
        monkeypatch.delenv(var, raising=False)
    assert bind_host() == "127.0.0.1"
    monkeypatch.setenv("MASTER_ADDR", "localhost")  # the route to a loopback host
    assert ipaddress.ip_address(bind_host()).is_loopback
    monkeypatch.setenv(BIND_ENV, "lo")  # an interface: its address
    assert bind_host() == "127.0.0.1"
    other = [a for name, addrs in interfaces().items() for a in addrs
             if not ipaddress.ip_address(a).is_loopback]
    if other:  # the route to one of this machine's own addresses is that address
        monkeypatch.delenv(BIND_ENV)
        host = f"[{other[0]}]" if ":" in other[0] else other[0]
        monkeypatch.setenv("TORCHFT_LIGHTHOUSE", f"http://{host}:29510")
        assert bind_host() == other[0]


@pytest.mark.parametrize("value, says", [
    ("nosuchif9", "is neither an interface of this machine"),
    ("192.0.2.254", "is not an address of this machine"),
    ("0.0.0.0", "is every interface"),
    ("::", "is every interface")])
def test_a_bad_bind_is_one_sentence(value, says):
    with pytest.raises(ConfigError, match=says) as e:
        resolve(value)
    assert str(e.value).count(". ") == 0 and str(e.value).endswith(".")


def test_remote_nodes_take_an_interface_name_or_an_address():
    assert check_bind("eth7", here=False) == "eth7"  # on the nodes, not here
    assert check_bind("10.1.2.3", here=False) == "10.1.2.3"
    for bad, says in (("bad name!", "neither an interface name"), ("[::]", "every interface")):
        with pytest.raises(ConfigError, match=says):
            check_bind(bad, here=False)


def test_the_component_bind_reaches_every_role():
    pytest.importorskip("torchx")
    from lowband.launch.component import train

    for elastic in (False, True):
        app = train("--model", "nano", bind="eth7", elastic=elastic)
        assert [r.env[BIND_ENV] for r in app.roles] == ["eth7"] * len(app.roles)
    # without it: the Lighthouse routes to its own node, named by the rank-0 host variable
    lighthouse = train("--model", "nano", elastic=True).roles[0]
    assert BIND_ENV not in lighthouse.env and lighthouse.env[RANK0_ENV] == "${rank0_env}"
    with pytest.raises(ValueError, match="every interface"):
        train("--model", "nano", bind="0.0.0.0")


def test_launch_binds_loopback_locally_and_refuses_a_missing_interface(capsys):
    pytest.importorskip("torchx")
    from lowband.cli import main

    local = lowband.launch(["--model", "nano"], start=False)  # local_cwd: this machine only
    assert [r.env[BIND_ENV] for r in local.dryrun_info._app.roles] == ["127.0.0.1"]
    slurm = lowband.launch(["--model", "nano"], scheduler="slurm", bind="eth7", start=False)
    assert slurm.dryrun_info.request.materialize().count(f"{BIND_ENV}=eth7") == 2  # both nodes
    assert main(["launch", "--dryrun", "--bind", "nosuchif9", "--model", "nano"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "nosuchif9' is neither an interface" in err, err
