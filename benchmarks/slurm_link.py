"""ddp against streaming as Slurm jobs whose two nodes talk over a real throttled link.

A local Slurm cluster (lowband.testing.slurm_cluster) whose slurmd nodes each run on a test host of
their own (network namespaces lbs-n0, lbs-n1 on a bridge, each host's egress shaped to --rate; the
controller, slurmdbd and MariaDB in this namespace, joined to the bridge). Each algorithm is
submitted with `lowband.launch(scheduler="slurm")`, one replica a node, followed to its end;
prints tokens/s, compute utilization, outer bytes per token, the bytes the hosts' veths carried,
and streaming's ratio to ddp measured in the same run.

    sudo python benchmarks/slurm_link.py [--rate 100mbit] [--model mini] [--steps 36]
        [--sync-every 18] [--fragments 3] [--json F]

Needs root, Slurm's Debian packages, `ip`, `tc` and `unshare`; says why and exits 0 without them.
Stops a local cluster of lowband's that runs in another shape, and the one it starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from four_hosts import algo_flags, ratios, row  # benchmarks/four_hosts.py

import lowband
from lowband.testing.slurm_cluster import LocalSlurm, missing_tools


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--model", default="mini")
    p.add_argument("--steps", type=int, default=36)
    p.add_argument("--sync-every", type=int, default=18)
    p.add_argument("--fragments", type=int, default=3)
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    cluster = LocalSlurm(nodes=2, link=a.rate)
    why = ("needs root" if os.geteuid() != 0 else
           f"needs Slurm's packages ({', '.join(missing_tools())} missing)" if missing_tools()
           else cluster.hosts().unavailable())
    if why:
        print(f"slurm_link: skipped: it {why}.")
        return 0
    out, rows = Path(tempfile.mkdtemp(prefix="lowband-slurm-link-")), {}
    os.chdir(out)  # the jobs run (and TorchX writes their slurm-*.out) here
    os.environ.update(cluster.env())
    os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])
    try:
        cluster.up()
        hosts = cluster.hosts()
        for name, flags in algo_flags(a).items():
            before = hosts.counters()
            h = lowband.launch(flags, scheduler="slurm", cpu=2, memMB=4000,
                               run_dir=str(out / name))
            state = h.wait(1800)
            if state != "succeeded":
                print(f"slurm_link: {name} {state}; logs: {out / name / 'logs'}")
                return 1
            after = hosts.counters()
            veth = sum(after[d]["tx_bytes"] - before[d]["tx_bytes"] for d in after)
            rows[name] = row(name, h.summary(), f", {h.app_handle}, the veths carried {veth:,} B")
            rows[name].update(veth_tx_bytes=veth, job=h.app_handle)
    finally:
        cluster.down()
    print(f"streaming/ddp over Slurm on a {a.rate} link: {ratios(rows)}")
    if a.json:
        Path(a.json).write_text(json.dumps({"settings": vars(a), "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
