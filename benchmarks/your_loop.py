"""Your loop against lowband's: examples/nanogpt.py (lowband.Sync) and `lowband train`, side by
side, over the same emulated 100 Mbit/s link.

Both train the same model: the example's own GPT class (examples/nanogpt.py: 4 blocks, width
128, byte vocabulary, tied embeddings; 0.84M parameters, the size of the main job's `micro`),
which the lowband side hands to lowband.train.train(cfg, model=GPT(...)) in each rank of its
torchrun job. Everything else is the main job's (`lowband recipes main`): Streaming DiLoCo,
R=2, H=20, 4 fragments, overlap 1, fp4-e3m0, batch 8 x 128, lr 3e-3 with 10 warm-up steps and
cosine to a tenth, evaluation every 50 steps (4 batches, left out of the training time), the
emulated link at 100 Mbit/s and 10 ms; both read the built-in corpus (the standard library's
source, as bytes) and run with the same threads a rank. The runs alternate, example first in odd
pairs and lowband train first in even ones, so machine noise hits both alike. Prints each run's
tokens/s (summary.json: tokens over training seconds), the medians and their ratio (goal: the
example's within 5% of lowband train's), and outer-link bytes per token (goal: the same). On a
shared machine a burst of load in one run moves its tokens/s, so each run's median step time
(rank 0's step events) is printed beside it, and the ratio of their medians: the steady step's
cost, which such a burst barely moves.

    python benchmarks/your_loop.py [--pairs 3] [--steps 200]

Takes about 25 s a run on an idle 2-core machine (2 x pairs runs).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import describe  # benchmarks/machine.py

from lowband.data import builtin_path
from lowband.launch.local import free_port
from lowband.telemetry import read_events

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "nanogpt.py"
SIDES = ("example", "lowband train")


def example_module():
    spec = importlib.util.spec_from_file_location("nanogpt_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_worker(run_dir: str, data: str, steps: int) -> None:
    """One rank of the lowband side (under torchrun): the main job with the example's model."""
    import torch
    from lowband import recipes
    from lowband.train import train

    cfg = recipes.get("main")(steps=steps, data=data, run_dir=run_dir, progress=False)
    torch.manual_seed(0)
    train(cfg, model=example_module().GPT(256, cfg.seq_len))


def run(side: str, run_dir: Path, data: str, steps: int) -> tuple[dict, float, float]:
    """One run of a side, as its own torchrun job: (summary.json, seconds end to end, median
    step seconds on rank 0)."""
    if side == "example":
        argv = [str(EXAMPLE), "--data", data, "--steps", str(steps), "--lr", "3e-3",
                "--run-dir", str(run_dir)]
    else:
        argv = [__file__, "--worker", str(run_dir), "--data", data, "--steps", str(steps)]
    threads = str(max(1, (os.cpu_count() or 1) // 2))  # what lowband train sets a rank (2 ranks)
    env = {**os.environ, "OMP_NUM_THREADS": threads}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *argv]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    took = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{side} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    step_s = statistics.median(e["step_s"] for e in read_events(run_dir, ("step",))
                               if e["rank"] == 0)
    return json.loads((run_dir / "summary.json").read_text()), took, step_s


def verdict(ratio: float) -> str:
    return f"{'PASS' if abs(ratio - 1) <= 0.05 else 'MISS'} (goal: within 5%)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--data", help="(default: the built-in corpus)")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # a rank of the lowband side
    args = p.parse_args(argv)
    data = args.data or str(builtin_path())
    if args.worker:
        train_worker(args.worker, data, args.steps)
        return 0
    n_params = sum(q.numel() for q in example_module().GPT(256, 128).parameters())
    print(f"machine: {describe(load=True)}", flush=True)
    print(f"model: examples/nanogpt.py's GPT, {n_params:,} parameters, in both; streaming R=2, "
          f"the main job's settings, {args.steps} steps, emulated 100 Mbit/s 10 ms link")
    tok_s = {s: [] for s in SIDES}
    per_token = {s: [] for s in SIDES}
    steps = {s: [] for s in SIDES}
    with tempfile.TemporaryDirectory() as out:
        for pair in range(args.pairs):
            order = SIDES if pair % 2 == 0 else SIDES[::-1]
            for side in order:
                s, took, step_s = run(side, Path(out) / f"{side.replace(' ', '-')}-{pair}", data,
                                      args.steps)
                tok_s[side].append(s["tokens_per_s"])
                steps[side].append(step_s)
                per_token[side].append(s["outer_wire_bytes"] / s["tokens"])
                print(f"  pair {pair + 1} {side:<13} {s['tokens_per_s']:>9,.0f} tokens/s  "
                      f"outer {s['outer_wire_bytes']:,} B ({per_token[side][-1]:.2f} B/token)  "
                      f"median step {1000 * step_s:.1f} ms  val loss {s['final_val_loss']:.4f}  "
                      f"{took:.1f} s end to end", flush=True)
    med = {s: statistics.median(v) for s, v in tok_s.items()}
    ratio = med["example"] / med["lowband train"]
    pairs = [a / b for a, b in zip(tok_s["example"], tok_s["lowband train"])]
    print(f"median tokens/s: example {med['example']:,.0f}, lowband train "
          f"{med['lowband train']:,.0f}; ratio example / lowband train = {ratio:.3f} (pairs: "
          + ", ".join(f"{r:.3f}" for r in pairs) + f") -> {verdict(ratio)}")
    step = {s: statistics.median(v) for s, v in steps.items()}
    print(f"median step: example {1000 * step['example']:.1f} ms, lowband train "
          f"{1000 * step['lowband train']:.1f} ms; ratio lowband train / example = "
          f"{step['lowband train'] / step['example']:.3f} (as tokens/s: example / lowband train) "
          f"-> {verdict(step['lowband train'] / step['example'])}")
    same = set(per_token["example"]) == set(per_token["lowband train"]) and \
        len(set(per_token["example"])) == 1
    print(f"outer bytes per token: example {statistics.median(per_token['example']):.3f}, "
          f"lowband train {statistics.median(per_token['lowband train']):.3f} -> "
          f"{'PASS' if same else 'MISS'} (goal: the same in every run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
