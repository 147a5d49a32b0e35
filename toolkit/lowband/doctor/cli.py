"""`lowband doctor`: its flags, the order of the checks and what it prints.

Alone: this machine (here.py), then the transport measured over loopback between this process
and a second doctor it starts (nodes.py and measure.py, as across machines). With --nodes N
--rdzv HOST:PORT, on every node of a job: this machine, the checks across the nodes, and when
they pass, the link measured and, on the first node, `lowband plan` for the config given after
the doctor's own flags (lowband train's options) on the measured link. Exit status 0 when
nothing failed, 1 when a check failed (each failure one sentence), 2 for bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from lowband.config import ArgParser, ConfigError
from lowband.doctor import here, nodes as across
from lowband.doctor.measure import measure
from lowband.options import BIND_ENV, NODE_ENV, RUN_DIR_ENV, SECRET_ENV

DESCRIPTION = (
    "Check that a run can work before it starts, and measure the link it will have. Alone: "
    "this machine (torch, backends, extras, memory, disk, the interface lowband binds) and the "
    "transport over loopback. On every node of a job, with --nodes N --rdzv HOST:PORT (the "
    "first node's address and the rendezvous port): also the rendezvous reachable from every "
    "node, every port the run uses open both ways, each node's name resolving to the address "
    "it binds, the secret present and equal, the clocks close; then the link measured with "
    "gloo (each way, latency, several streams) and, on the first node, `lowband plan` for the "
    "config given after the doctor's flags on that link. Each failure is one sentence.")
EXAMPLE = ("examples: lowband doctor; lowband doctor --nodes 2 --rdzv 10.0.0.1:29500 --bind eth1 "
           "--save-link link.json -- --model mini --algo streaming")


def parser() -> ArgParser:
    p = ArgParser(prog="lowband doctor", description=DESCRIPTION, epilog=EXAMPLE)
    p.add_argument("--nodes", type=int, default=0, help="nodes of the job, every one running "
                   "the doctor (default: this machine alone)")
    p.add_argument("--rdzv", metavar="HOST:PORT", help="the first node's address (or name) and "
                   "port, where the job's rendezvous will be (port default 29500)")
    p.add_argument("--bind", metavar="INTERFACE_OR_ADDRESS", help="the interface or address "
                   "the run binds on this node (lowband launch --bind; default: the interface "
                   "that routes to the rendezvous host)")
    p.add_argument("--secret", metavar="FILE", help="the run's secret, RUN_DIR/secret of a "
                   f"launched job (default: ${SECRET_ENV}): checked present and equal on every "
                   "node")
    p.add_argument("--elastic", action="store_true", help="also check the Lighthouse's port on "
                   "the first node (an --elastic job)")
    p.add_argument("--lighthouse-port", type=int, default=29510, help="the Lighthouse's port "
                   "(default: 29510, lowband launch's)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a node waits for the "
                   "others at the rendezvous (default: 60)")
    p.add_argument("--save-link", metavar="FILE", help="write the measured link to FILE (JSON), "
                   "for `lowband plan --link FILE`, `lowband compare -- --link FILE` and "
                   "`lowband train --link FILE`")
    p.add_argument("--step-time", help="the plan's compute seconds of one step (lowband plan "
                   "--step-time; default: probed on the first node, a few steps of the config's "
                   "model)")
    p.add_argument("--no-plan", action="store_true", help="print no plan on the measured link "
                   "(lowband launch --doctor with a script, whose config is the script's)")
    # the second doctor of a loopback measurement: never the rendezvous's host (not for users)
    p.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    return p


def _print(title: str, checks) -> None:
    print(title, flush=True)
    for level, text in checks:
        print(f"  {'FAIL' if level == 'fail' else level:<5} {text}", flush=True)


def _config(flags: list[str]):
    from lowband.flags import config_of_args, train_parser

    args = vars(train_parser(prog="lowband doctor", resume=False).parse_args(flags))
    return config_of_args(args, here=False, file_here=True)[0]


def _rdzv(value: str | None, nodes: int) -> tuple[str, int]:
    """(host, port) of --rdzv HOST[:PORT] (an IPv6 address in brackets)."""
    if not value:
        raise ConfigError(f"--nodes {nodes} needs --rdzv HOST:PORT: the first node's address on "
                          "the link between the nodes, and the rendezvous port.")
    host, sep, port = value.rpartition(":")
    if not sep or not host or (":" in host and not host.endswith("]")):
        host, port = value, "29500"
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise ConfigError(f"--rdzv {value!r} is not HOST:PORT (e.g. 10.0.0.1:29500).") from None


def main(argv: list[str]) -> int:
    """Under `lowband launch --doctor` (the job's run directory and this node's name in the
    environment) what it prints also goes to RUN/logs/<node>.log, as the node agent's does."""
    run_dir, node = os.environ.get(RUN_DIR_ENV), os.environ.get(NODE_ENV)
    if not (run_dir and node):
        return _main(argv)
    log = Path(run_dir) / "logs" / f"{node}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as copy, contextlib.redirect_stdout(_Both(sys.stdout, copy)):
        return _main(argv)


class _Both:
    """A stream that writes to two."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()


def _main(argv: list[str]) -> int:
    args, flags = parser().parse_known_args(argv)
    if "--" in flags:
        flags.remove("--")
    cfg = _config(flags)
    if args.bind:
        from lowband.comm.membership.bind import check_bind

        os.environ[BIND_ENV] = check_bind(args.bind, here=True)
    peer, port = None, 0
    if args.nodes:
        if args.nodes < 2:
            raise ConfigError(f"--nodes {args.nodes}: a job across machines has 2 or more nodes "
                              "(alone, `lowband doctor` checks this machine).")
        peer, port = _rdzv(args.rdzv, args.nodes)
    checks = here.software() + here.resources(cfg, max(1, cfg.world // max(args.nodes, 1)))
    net, address = here.network(peer)
    if not args.client:
        _print(f"lowband doctor: this machine ({socket.gethostname()})", checks + net)
    if address is None or any(level == "fail" for level, _ in checks + net):
        return 1
    if args.nodes:
        return across_nodes(args, flags, peer, port, address)
    return _loopback(args)


def across_nodes(args, flags: list[str], peer: str, port: int, address: str) -> int:
    """The checks across the nodes, then the link and (on the first node) the plan."""
    from lowband.comm.membership.bind import is_local, is_loopback

    loopback = is_loopback(peer)
    resolved = across.resolve_first(peer)
    first = not args.client and resolved is not None and is_local(resolved)
    if first and not loopback and is_loopback(resolved):
        print(f"  FAIL  the rendezvous host {peer} resolves here to {resolved}, a loopback "
              "address the other nodes cannot reach: give --rdzv this node's address on the "
              "link between the nodes.", flush=True)
        return 1
    rdzv = f"{peer}:{port}"
    os.environ[BIND_ENV] = address  # every listener of the doctor's binds it, as the run's will
    try:
        try:
            meeting = across.Meeting(peer, port, args.nodes, first, address, args.timeout)
        except across.Stop:
            if not (first and loopback):
                raise
            # several nodes of a job on this machine (lowband launch, local_cwd): the first to
            # serve the rendezvous is its host, the others join it
            meeting = across.Meeting(peer, port, args.nodes, False, address, args.timeout)
        me = across.describe(address)
        me["secret"] = across.secret_state(args.secret or os.environ.get(SECRET_ENV),
                                           meeting.nonce)
        found = across.check_nodes(meeting, me, rdzv, loopback,
                                   args.lighthouse_port if args.elastic else None)
    except across.Stop as e:
        print(f"  FAIL  {e}", flush=True)
        return 1
    everyone = found.pop("nodes")
    if not args.client:
        title = (f"lowband doctor: across {args.nodes} nodes (rendezvous {rdzv}; this node: "
                 f"{across.label(everyone[meeting.index])})" if not loopback else
                 f"lowband doctor: the transport on this machine (two doctors, {rdzv})")
        _print(title, [("ok", s) for s in found["passed"]] + [("note", s) for s in found["notes"]]
               + [("fail", s) for s in found["failures"]])
    if found["failures"]:
        return _leave(meeting, 1)
    link = _measure(meeting, everyone, address, args.timeout)
    if not args.client:
        from lowband.comm.link import describe_measured

        print(f"link: {describe_measured(link)}", flush=True)
    if meeting.index == 0 and args.save_link:
        from lowband.comm.link import write_measured

        write_measured(args.save_link, link)
        print(f"saved: {args.save_link} (lowband plan --link {args.save_link})", flush=True)
    if meeting.index == 0 and not loopback and not args.no_plan:
        plan_on(link, flags, args.save_link, args.step_time)
    elif meeting.index == 0 and not args.client:
        print("across machines: `lowband doctor --nodes N --rdzv HOST:PORT` on every node",
              flush=True)
    return _leave(meeting, 0)


def _measure(meeting, everyone: list[dict], address: str, timeout: float) -> dict:
    """The link, measured in a gloo world of the nodes on the interface the run binds."""
    import torch.distributed as dist

    from lowband.comm.membership.bind import bind_gloo

    bind_gloo()
    store = dist.PrefixStore(across.PREFIX + "gloo", meeting.store)
    dist.init_process_group("gloo", store=store, rank=meeting.index, world_size=meeting.nodes,
                            timeout=timedelta(seconds=max(60.0, timeout)))
    try:
        made = measure(meeting.index, everyone)
        if made is not None:
            meeting.put("link", made)
        return meeting.get("link")
    finally:
        dist.destroy_process_group()


def _leave(meeting, code: int) -> int:
    """Say this node is done; the first node waits (bounded) until every node is, so that no
    node loses the store while it still reads from it."""
    meeting.put(f"bye/{meeting.index}", code)
    if meeting.index == 0:
        deadline = time.monotonic() + meeting.timeout
        keys = [f"{across.PREFIX}bye/{i}" for i in range(meeting.nodes)]
        while not all(meeting.store.check([k]) for k in keys) and time.monotonic() < deadline:
            time.sleep(0.05)
    return code


def plan_on(link: dict, flags: list[str], saved: str | None, step_time: str | None) -> None:
    """`lowband plan` for the config of `flags` on the measured link, and its one sentence."""
    from lowband.options import UserError
    from lowband.plan.cli import run_plan, table

    on_link = (["--link", saved] if saved else
               ["--link-bandwidth", f"{link['bandwidth_bps']:.0f}bit",
                "--link-latency", f"{link['latency_s']:.6f}s"])
    step = ["--step-time", step_time or "probe"]
    try:
        result, _ = run_plan([*flags, *on_link, *step])
    except UserError as e:
        print(f"  note  no plan for this config on this link: {e}", flush=True)
        return
    print("\nlowband plan on the measured link:\n" + table(result), flush=True)
    rows = result["algorithms"]
    cus = [(name, rows[name]["cu"]) for name in dict.fromkeys([result["algorithm"], "ddp"])
           if name in rows and rows[name].get("cu") is not None]
    if cus:
        (name, cu), rest = cus[0], "".join(f"; {n} {c:.0%}" for n, c in cus[1:])
        print(f"\non this link {name} reaches {cu:.0%} compute utilization{rest}.", flush=True)


def _loopback(args) -> int:
    """The transport on this machine: a second doctor started here, both on loopback."""
    from lowband.launch.local import free_port

    port = free_port()
    child = subprocess.Popen([sys.executable, "-m", "lowband.doctor", "--nodes", "2", "--rdzv",
                              f"127.0.0.1:{port}", "--client", "--timeout", str(args.timeout)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={k: v for k, v in os.environ.items() if k != BIND_ENV})
    args.nodes = 2
    try:
        code = across_nodes(args, [], "127.0.0.1", port, "127.0.0.1")
    finally:
        out, _ = child.communicate(timeout=args.timeout + 30)
    if child.returncode not in (0, 1) or (child.returncode and not code):
        print(f"  FAIL  the second doctor on loopback failed: {out.strip()[-500:]}", flush=True)
        return 1
    return code
