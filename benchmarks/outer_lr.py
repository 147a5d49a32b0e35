"""The outer learning rate swept against its default (issue 30: "Defaults from the evidence").

Streaming DiLoCo as the main job runs it (`lowband train --recipe main`: model micro, fp4-e3m0,
P=4 strided fragments, tau=1, alpha=0.5, H=20, the emulated 100 Mbit/s link) with --replicas R,
once for each outer lr of --grid and once with --outer-lr unset (the default for R and H,
algorithms/outer.py default_outer_lr), each with the same seed and data, one run after another.
Prints each run's final validation loss, the best of the grid, and the default's relative gap
to it. Goal (issue 30): at R=4 the default within 1% of the best of 0.4 / 0.6 / 0.8 / 1.0.

    python benchmarks/outer_lr.py [--replicas 4 [2]] [--steps 300] [--grid 0.4 0.6 0.8 1.0]
        [--eval-batches 16] [--keep DIR] [--json out.json]

The default at R=4, H=20 is 0.571 (0.6 at H=30, less 0.05 x log2(30/20)); a default that falls
on a grid value reuses that run. Validation is once, at the end, on --eval-batches held-out
micro-batches a rank (the same batches in every run), so the losses differ by the outer lr alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import describe  # benchmarks/machine.py
from slow_link import revision

from lowband import recipes

GOAL = 0.01  # the default's final validation loss within 1% of the grid's best (at R=4)


def train(run_dir: Path, replicas: int, a, outer_lr: float | None) -> dict:
    """One run of the main recipe; its final validation loss and the outer lr it recorded."""
    cmd = [sys.executable, "-m", "lowband.cli", "train", "--recipe", "main", "--replicas",
           str(replicas), "--steps", str(a.steps), "--eval-every", "0", "--eval-batches",
           str(a.eval_batches), "--seed", str(a.seed), "--no-progress", "--run-dir", str(run_dir),
           "--overwrite", *(["--outer-lr", str(outer_lr)] if outer_lr is not None else [])]
    summary, config, wall_s = finished(cmd, run_dir)
    return {"outer_lr": config["outer_lr"], "default": outer_lr is None,
            "final_val_loss": summary["final_val_loss"], "wall_s": wall_s}


def finished(cmd: list[str], run_dir: Path) -> tuple[dict, dict, float]:
    """Run `lowband train` (cmd) into run_dir: its summary.json, its config.json and the
    seconds it took; a failed run ends the benchmark with its command and stderr."""
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    return (json.loads((run_dir / "summary.json").read_text()),
            json.loads((run_dir / "config.json").read_text()), round(time.monotonic() - t0, 1))


def sweep(replicas: int, a, root: Path) -> dict:
    rows = []
    for lr in a.grid:
        rows.append(train(root / f"R{replicas}-lr{lr:g}", replicas, a, lr))
        print(f"  R={replicas} outer lr {lr:g}: final val loss {rows[-1]['final_val_loss']:.4f} "
              f"({rows[-1]['wall_s']:.0f} s)", flush=True)
    default = recipes.main(replicas=replicas).outer_lr
    same = next((r for r in rows if r["outer_lr"] == default), None)
    row = dict(same, default=True) if same else train(root / f"R{replicas}-default", replicas, a, None)
    rows.append(row)
    best = min(rows[:len(a.grid)], key=lambda r: r["final_val_loss"])
    gap = row["final_val_loss"] / best["final_val_loss"] - 1
    return {"replicas": replicas, "rows": rows, "best_outer_lr": best["outer_lr"],
            "best_val_loss": best["final_val_loss"], "default_outer_lr": row["outer_lr"],
            "default_val_loss": row["final_val_loss"], "default_gap": gap}


def table(result: dict) -> list[str]:
    best = result["best_val_loss"]
    lines = ["| R | outer lr | final val loss | vs best of grid |", "|---|---|---|---|"]
    for r in result["rows"]:
        name = f"{r['outer_lr']:g}" + (" (default)" if r["default"] else "")
        lines.append(f"| {result['replicas']} | {name} | {r['final_val_loss']:.4f} | "
                     f"{(r['final_val_loss'] / best - 1) * 100:+.2f}% |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[4], help="R of each sweep")
    p.add_argument("--steps", type=int, default=300, help="training steps (the main job: 200)")
    p.add_argument("--grid", type=float, nargs="+", default=[0.4, 0.6, 0.8, 1.0])
    p.add_argument("--eval-batches", type=int, default=16, help="held-out micro-batches a rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", help="keep the run directories here (default: a temporary one)")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M")
    print(f"machine: {describe(load=True)}; lowband {revision()}; {started}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.keep or tmp)
        results = [sweep(R, a, root) for R in a.replicas]
    print(f"\nstreaming, the main recipe (micro, H=20, P=4, fp4-e3m0), {a.steps} steps, seed "
          f"{a.seed}; machine at the end: {describe(load=True)}")
    status = 0
    for result in results:
        print("\n".join(["", *table(result)]))
        gap, R = result["default_gap"], result["replicas"]
        verdict = ("PASS" if gap <= GOAL else "MISS") if R == 4 else "(goal set at R=4 only)"
        print(f"R={R}: best of the grid outer lr {result['best_outer_lr']:g} "
              f"({result['best_val_loss']:.4f}); default {result['default_outer_lr']:g} "
              f"{gap * 100:+.2f}% against it (goal: within {GOAL:.0%}) {verdict}")
        status |= R == 4 and gap > GOAL
    if a.json:
        Path(a.json).write_text(json.dumps({"steps": a.steps, "seed": a.seed, "started": started,
                                            "machine": describe(), "results": results}, indent=1))
    return int(status)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
