"""lowband plan against lowband's own runs on the emulated link, side by side.

Runs ddp, diloco and streaming with 2 replicas on an emulated outer link, then predicts each
run's compute utilization from its config and its own measured compute time per step
(lowband.plan.check_run) and prints predicted vs measured (goal: within 10 points).

    python benchmarks/plan_check.py [--model micro] [--steps 60] [--bandwidth 100Mbit 30Mbit]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from lowband.plan import check_run

ALGOS = {"ddp": [], "diloco": ["--sync-every", "20"],
         "streaming": ["--sync-every", "20", "--fragments", "4"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="micro")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--bandwidth", nargs="+", default=["100Mbit", "30Mbit"])
    args = p.parse_args(argv)
    rows, worst = [], 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for bw in args.bandwidth:
            for algo, flags in ALGOS.items():
                run = Path(tmp) / f"{algo}-{bw}"
                subprocess.run([sys.executable, "-m", "lowband.cli", "train", "--algo", algo, *flags,
                                "--model", args.model, "--steps", str(args.steps),
                                "--link-bandwidth", bw, "--link-latency", "0ms",
                                "--eval-every", "0", "--no-progress",
                                "--run-dir", str(run)], check=True, stdout=subprocess.DEVNULL)
                r = check_run(run)
                diff = r["predicted_cu"] - r["measured_cu"]
                worst = max(worst, abs(diff))
                rows.append(f"{bw:>9s}  {algo:9s}  {1000 * r['step_time']:8.1f}  "
                            f"{r['measured_cu']:8.3f}  {r['predicted_cu']:9.3f}  {100 * diff:+6.1f}")
    print(f"model {args.model}, 2 replicas, {args.steps} steps, emulated outer link")
    print(f"{'link':>9s}  {'algorithm':9s}  {'step ms':>8s}  {'measured':>8s}  {'predicted':>9s}  {'pp':>6s}")
    print("\n".join(rows))
    print(f"largest difference: {100 * worst:.1f} points (goal <= 10): {'PASS' if worst <= 0.10 else 'MISS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
