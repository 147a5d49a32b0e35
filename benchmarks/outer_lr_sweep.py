"""The outer learning rate swept per outer rule and codec (issue 46): which outer lr is best for
dense fp4 with Nesterov, top-k with error feedback and Nesterov, and top-k with SparseLoCo's rule?

Streaming on nano (P=2 fragments, tau=1, alpha=0.5), R=2, H=20, 300 steps, no link emulation (a
fixed schedule's losses do not depend on the link), once for each outer lr of --grid and once
with --outer-lr unset (the default, algorithms/outer.py outer_lr_for: default_outer_lr(R, H)
times OUTER_LR_FACTOR of the rule and codec kind), for each set-up and each seed of --seeds, one
run after another, the same data in every run. Validation once, at the end, on --eval-batches
held-out micro-batches a rank.

Prints the final validation loss of every outer lr, the set-ups side by side (the mean over the
seeds), each set-up's best and its ratio to fp4's best, the default's gap to the best, and the
factor on default_outer_lr that the best would be (what OUTER_LR_FACTOR would hold, were a sweep
on a quiet machine with several seeds to support it: the seed-to-seed spread is ~1%, see
RESULTS.md "outer lr").

    python benchmarks/outer_lr_sweep.py [--steps 300] [--grid 0.2 0.4 0.6 0.8 1.0]
        [--seeds 0 1] [--setups fp4 topk topk-sparseloco] [--dir DIR] [--json out.json]
    python benchmarks/outer_lr_sweep.py --smoke   # a few steps: the script works, no figures
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from machine import describe  # benchmarks/machine.py
from outer_lr import finished  # benchmarks/outer_lr.py
from slow_link import revision

from lowband.config import Config

# the set-ups: name -> (what it is, its options)
SETUPS = {
    "fp4": ("dense fp4-e3m0, Nesterov", {"codec": "fp4-e3m0"}),
    "topk": ("topk-2bit with error feedback, Nesterov", {"codec": "topk-2bit"}),
    "topk-sparseloco": ("topk-2bit, SparseLoCo's rule", {"codec": "topk-2bit",
                                                         "outer_rule": "sparseloco"}),
}
MODEL, H = "nano", 20
BASE = ["--algo", "streaming", "--model", MODEL, "--sync-every", str(H), "--link-bandwidth",
        "none", "--eval-every", "0", "--no-progress", "--overwrite"]


def flags_of(options: dict) -> list[str]:
    return [x for k, v in options.items() for x in ("--" + k.replace("_", "-"), str(v))]


def default_of(options: dict, a) -> float:
    """The outer lr a run of this set-up takes with --outer-lr unset (what config.json records)."""
    return Config(algo="streaming", model=MODEL, replicas=a.replicas, sync_every=H,
                  **options).validate().outer_lr


def train(run_dir: Path, flags: list, a, seed: int, outer_lr: float | None) -> dict:
    """One run: its final validation loss and the outer lr its config.json recorded."""
    cmd = [sys.executable, "-m", "lowband.cli", "train", *BASE, *flags, "--replicas",
           str(a.replicas), "--steps", str(a.steps), "--eval-batches", str(a.eval_batches),
           "--seed", str(seed), "--run-dir", str(run_dir), *a.extra,
           *(["--outer-lr", str(outer_lr)] if outer_lr is not None else [])]
    summary, config, wall_s = finished(cmd, run_dir)
    return {"outer_lr": config["outer_lr"], "seed": seed, "final_val_loss":
            summary["final_val_loss"], "wall_s": wall_s}


def sweep(name: str, a, root: Path) -> dict:
    """Every outer lr of the grid and the default (a run of its own unless it is on the grid),
    for every seed; the mean loss of each over the seeds."""
    what, options = SETUPS[name]
    default = default_of(options, a)
    losses: dict[float, list[float]] = {}
    for seed in a.seeds:
        for lr in [*a.grid] + ([] if default in a.grid else [None]):
            tag = "default" if lr is None else f"{lr:g}"
            r = train(root / f"{name}-s{seed}-lr{tag}", flags_of(options), a, seed, lr)
            assert lr is not None or r["outer_lr"] == default, (r, default)
            losses.setdefault(r["outer_lr"], []).append(r["final_val_loss"])
            print(f"  {name} seed {seed} outer lr {r['outer_lr']:g}"
                  f"{' (default)' if r['outer_lr'] == default else ''}: final val loss "
                  f"{r['final_val_loss']:.4f} ({r['wall_s']:.0f} s)", flush=True)
    mean = {lr: sum(v) / len(v) for lr, v in sorted(losses.items())}
    best = min((lr for lr in mean if lr in a.grid), key=mean.get)
    return {"setup": name, "what": what, "flags": flags_of(options),
            "losses": {str(k): v for k, v in sorted(losses.items())},
            "mean": {str(k): v for k, v in mean.items()}, "best_outer_lr": best,
            "best_val_loss": mean[best], "default_outer_lr": default,
            "default_val_loss": mean[default], "default_gap": mean[default] / mean[best] - 1,
            "factor": round(best / default, 3)}


def table(results: list[dict]) -> list[str]:
    """The set-ups side by side: a row per outer lr, the best and the default below."""
    lrs = sorted({float(k) for r in results for k in r["mean"]})
    head = "| outer lr | " + " | ".join(r["setup"] for r in results) + " |"
    lines = [head, "|---" * (len(results) + 1) + "|"]
    for lr in lrs:
        cells = []
        for r in results:
            v = r["mean"].get(str(lr))
            mark = ("**" if lr == r["best_outer_lr"] else "") if v is not None else ""
            note = " (default)" if lr == r["default_outer_lr"] else ""
            cells.append("—" if v is None else f"{mark}{v:.4f}{mark}{note}")
        lines.append(f"| {lr:g} | " + " | ".join(cells) + " |")
    fp4 = next((r for r in results if r["setup"] == "fp4"), None)
    for label, cell in (
            ("best", lambda r: f"{r['best_outer_lr']:g}"),
            ("best vs fp4's best", lambda r: f"{r['best_val_loss'] / fp4['best_val_loss']:.3f}x"
             if fp4 else "—"),
            ("default vs its best", lambda r: f"{r['default_gap'] * 100:+.2f}%"),
            ("factor on default_outer_lr", lambda r: f"{r['factor']:g}")):
        lines.append(f"| {label} | " + " | ".join(cell(r) for r in results) + " |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    p.add_argument("--grid", type=float, nargs="+", default=[0.2, 0.4, 0.6, 0.8, 1.0])
    p.add_argument("--replicas", type=int, default=2, help="R")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-batches", type=int, default=16, help="held-out micro-batches a rank")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--smoke", action="store_true", help="20 steps of short sequences, two "
                   "outer lrs: checks the script, measures nothing")
    p.add_argument("--dir", help="keep the run directories here (default: a temporary one)")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    a.extra = []
    if a.smoke:
        a.steps, a.grid, a.eval_batches = 20, [0.4, 0.8], 2
        a.extra = ["--seq-len", "32", "--batch-size", "4", "--warmup-steps", "2"]
    started = time.strftime("%Y-%m-%d %H:%M")
    print(f"machine: {describe(load=True)}; lowband {revision()}; {started}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.dir or tmp)
        results = [sweep(name, a, root) for name in a.setups]
    print(f"\nstreaming on nano, R={a.replicas}, H=20, {a.steps} steps, seeds "
          f"{' '.join(map(str, a.seeds))} (the mean final validation loss){' SMOKE' * a.smoke}; "
          f"machine at the end: {describe(load=True)}")
    for r in results:
        print(f"  {r['setup']}: {r['what']} ({' '.join(r['flags'])})")
    print("\n".join(["", *table(results)]))
    if a.json:
        Path(a.json).write_text(json.dumps({"steps": a.steps, "replicas": a.replicas,
                                            "seeds": a.seeds, "grid": a.grid, "smoke": a.smoke,
                                            "started": started, "machine": describe(),
                                            "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
