"""ddp against streaming over four real test hosts, R=4: tokens/s on a shaped bridge.

Four hosts (network namespaces lbf-h0..h3, 10.213.12.1-4, on a bridge; lowband.launch.hosts),
each host's egress shaped to 100 Mbit/s, each running the TorchX component's node command (one replica a
host, as benchmarks/multinode.py does for two). Prints each algorithm's tokens/s, compute
utilization, outer bytes per token and validation loss, and streaming's ratio to ddp measured in
the same run. With R=4 streaming's fp4 average takes the two-phase exchange (2(R-1)/R x the
payload a rank).

    sudo python benchmarks/four_hosts.py [--model mini] [--steps 36] [--sync-every 18]
        [--fragments 3] [--json F]

Needs root, `ip`, `tc` and `unshare`; says why and exits 0 without them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from multinode import run_job  # benchmarks/multinode.py

from lowband.launch.hosts import TestHosts


def algo_flags(a) -> dict[str, list[str]]:
    """The two runs compared, ddp and streaming, from the arguments (model, steps, H, P)."""
    common = ["--model", a.model, "--steps", str(a.steps), "--batch-size", "4", "--seq-len", "128",
              "--eval-every", "0", "--eval-batches", "2", "--link-bandwidth", "none"]  # the hosts' link
    return {"ddp": [*common, "--algo", "ddp"],
            "streaming": [*common, "--algo", "streaming", "--sync-every", str(a.sync_every),
                          "--fragments", str(a.fragments)]}


def row(name: str, summary: dict, extra: str = "") -> dict:
    """A run's figures from its summary, printed as one line."""
    r = {k: summary[k] for k in ("tokens_per_s", "compute_utilization", "outer_wire_bytes",
                                 "tokens", "final_val_loss")}
    print(f"{name:>9}: {r['tokens_per_s']:8,.0f} tokens/s, CU {100 * r['compute_utilization']:5.1f}%, "
          f"{r['outer_wire_bytes'] / r['tokens']:10,.1f} outer B/token, val loss "
          f"{r['final_val_loss']:.4f}{extra}", flush=True)
    return r


def ratios(rows: dict) -> str:
    d, s = rows["ddp"], rows["streaming"]
    return (f"tokens/s {s['tokens_per_s'] / d['tokens_per_s']:.2f}x, outer bytes per token 1/"
            f"{(d['outer_wire_bytes'] / d['tokens']) / (s['outer_wire_bytes'] / s['tokens']):.0f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mini")
    p.add_argument("--steps", type=int, default=36)
    p.add_argument("--sync-every", type=int, default=18)
    p.add_argument("--fragments", type=int, default=3)
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    hosts = TestHosts("lbf", "10.213.12", a.rate, "128kb", "100ms", hostnames=True, n=4)
    why = hosts.unavailable()
    if why:
        print(f"four_hosts: skipped: it {why}.")
        return 0
    out, rows = Path(tempfile.mkdtemp(prefix="lowband-four-hosts-")), {}
    try:
        hosts.setup()
        for port, (name, flags) in enumerate(algo_flags(a).items(), start=29611):
            job = run_job(hosts, flags, out / name, port, timeout=900)
            if any(job["codes"]):
                print(f"four_hosts: {name} failed {job['codes']}; logs: {job['logs']}")
                return 1
            rows[name] = row(name, json.loads((out / name / "summary.json").read_text()))
    finally:
        hosts.teardown()
    print(f"streaming/ddp: {ratios(rows)}")
    if a.json:
        Path(a.json).write_text(json.dumps({"settings": vars(a), "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
