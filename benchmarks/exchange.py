"""The outer average's two exchanges over four real test hosts: all-gather against two-phase.

Four hosts (network namespaces lbq-h0..h3, 10.213.11.1-4, on a bridge; lowband.launch.hosts),
each host's egress shaped to 100 Mbit/s, one rank a host, gloo over the hosts' addresses. Every rank
averages the same-sized fp32 vector (its own values) with Comm.average in each dense codec, once
with `exchange="all-gather"` and once with `exchange="two-phase"` (fp32: the all-reduce), a few
times each after a warm-up, and counts per average:
  telemetry  the bytes Comm recorded on the outer link (this rank's sends);
  veth       the bytes the rank's veth sent (tx_bytes, read inside its host), less 66 B of
             Ethernet+IPv4+TCP headers a packet: what TCP carried (a barrier's few bytes too);
  seconds    wall time of one average (start to result, encoding and decoding included; four
             ranks share this machine's cores), the slowest rank's.
Bytes are printed as multiples of the codec's encoded payload: the all-gather sends (R-1) = 3x,
the two-phase exchange 2 (R-1)/R = 1.5x (plus the padding of chunks to whole blocks).

    sudo python benchmarks/exchange.py [--numel 2000000] [--reps 3] [--rate 100mbit] [--json F]

Needs root, `ip`, `tc` and `unshare`; says why and exits 0 without them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from lowband.launch.hosts import TestHosts

HEADER_BYTES = 66  # Ethernet 14 + IPv4 20 + TCP 20 + timestamp option 12, per packet
CODECS = ("fp32", "bf16", "int8", "fp4-e3m0", "fp4-e2m1")
MODES = ("all-gather", "two-phase")
R = 4


def tcp_sent(dev: str) -> int:
    """Bytes TCP carried out of `dev` so far (this host's view of its veth)."""
    stat = Path("/sys/class/net") / dev / "statistics"
    return int((stat / "tx_bytes").read_text()) - HEADER_BYTES * int((stat / "tx_packets").read_text())


def worker(args) -> None:
    """One rank, in its host: every codec and exchange, results to args.out/rank<r>.json."""
    import torch
    import torch.distributed as dist

    from lowband.comm import topology
    from lowband.comm import Comm
    from lowband.comm.codecs import payload_bytes

    topo = topology.init(R, 1, "cpu")
    comm, dev = Comm(topo, None), os.environ["GLOO_SOCKET_IFNAME"]
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(topo.rank))
    rows = []
    for codec in CODECS:
        for mode in MODES[:1] if codec == "fp32" else MODES:
            comm.average(x, "outer", codec, 64, exchange=mode).wait()  # warm-up
            dist.barrier()
            tel, veth, t0 = comm.totals.wire_bytes["outer"], tcp_sent(dev), time.perf_counter()
            for _ in range(args.reps):
                comm.average(x, "outer", codec, 64, exchange=mode).wait()
            seconds = (time.perf_counter() - t0) / args.reps
            dist.barrier()  # every rank's sends are out before the counter is read
            rows.append({"codec": codec, "mode": "all-reduce" if codec == "fp32" else mode,
                         "payload": payload_bytes(codec, args.numel, 64), "seconds": seconds,
                         "telemetry": (comm.totals.wire_bytes["outer"] - tel) / args.reps,
                         "veth": (tcp_sent(dev) - veth) / args.reps})
    (Path(args.out) / f"rank{topo.rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def run(args) -> list[dict]:
    """The four ranks in the four hosts; rows averaged over ranks (seconds: the slowest)."""
    out = Path(tempfile.mkdtemp(prefix="lbq-exchange-"))
    hosts = TestHosts("lbq", "10.213.11", args.rate, "128kb", "100ms", hostnames=True, n=R)
    with hosts:
        procs = []
        for i in range(R):
            env = {**os.environ, "RANK": str(i), "WORLD_SIZE": str(R), "MASTER_ADDR": hosts.addrs[0],
                   "MASTER_PORT": str(args.port), "GLOO_SOCKET_IFNAME": hosts.devs[i],
                   "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}  # four ranks, few cores
            cmd = [sys.executable, __file__, "--worker", "--out", str(out), "--numel",
                   str(args.numel), "--reps", str(args.reps)]
            procs.append(hosts.popen(i, cmd, env, out / f"rank{i}.log"))
        codes = [p.wait(timeout=args.timeout) for p in procs]
        if any(codes):
            logs = "\n".join((out / f"rank{i}.log").read_text(errors="replace")[-3000:] for i in range(R))
            raise RuntimeError(f"ranks exited with {codes}:\n{logs}")
    ranks = [json.loads((out / f"rank{i}.json").read_text()) for i in range(R)]
    rows = []
    for cells in zip(*ranks):
        row = dict(cells[0])
        for key in ("telemetry", "veth"):
            row[key] = sum(c[key] for c in cells) / R
        row["seconds"] = max(c["seconds"] for c in cells)
        rows.append(row)
    return rows


def table(rows: list[dict], args) -> str:
    by = {(r["codec"], r["mode"]): r for r in rows}
    lines = [f"R={R} ranks, one a host, each host's egress {args.rate}; {args.numel:,} fp32 values "
             f"averaged {args.reps}x a case; bytes a rank a average as multiples of the encoded "
             "payload (telemetry / veth TCP payload), seconds of the slowest rank",
             f"{'codec':9} {'payload B':>11} | {'all-gather':^24} | {'two-phase':^24} | "
             f"{'bytes':>6} {'time':>6}",
             f"{'':9} {'':>11} | {'tel':>6} {'veth':>6} {'s/avg':>9} | {'tel':>6} {'veth':>6} "
             f"{'s/avg':>9} | {'ratio':>6} {'ratio':>6}"]

    def cell(r):
        p = r["payload"]
        return f"{r['telemetry'] / p:5.3f}x {r['veth'] / p:5.3f}x {r['seconds']:8.3f}s"

    for codec in CODECS:
        if codec == "fp32":
            r = by["fp32", "all-reduce"]
            lines.append(f"{codec:9} {r['payload']:>11,} | {cell(r)} | {'(fp32: one all-reduce)':^24} |")
            continue
        a, t = by[codec, "all-gather"], by[codec, "two-phase"]
        lines.append(f"{codec:9} {a['payload']:>11,} | {cell(a)} | {cell(t)} | "
                     f"{t['veth'] / a['veth']:6.3f} {t['seconds'] / a['seconds']:6.3f}")
    worst = max(by[c, "two-phase"]["veth"] / by[c, "two-phase"]["payload"] for c in CODECS[1:])
    lines.append(f"{'PASS' if worst <= 2.1 else 'MISS'}: two-phase at most {worst:.3f}x the "
                 "encoded payload on the veth (goal <= 2.1x; the all-gather sends 3x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=2_000_000, help="values a rank averages")
    p.add_argument("--reps", type=int, default=3, help="timed averages a case")
    p.add_argument("--rate", default="100mbit", help="each host's egress")
    p.add_argument("--port", type=int, default=29631)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    why = TestHosts("lbq", "10.213.11", args.rate, "128kb", "100ms", hostnames=True, n=R).unavailable()
    if why:
        print(f"exchange benchmark skipped: it {why}.")
        return 0
    rows = run(args)
    print(table(rows, args))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
