"""Stragglers and loss spikes: ddp, diloco, edit and aedit with a slow replica, and diloco vs edit
with a corrupted one.

(a) stragglers. R=2, S=1, replica 1 computes 4x slower (--straggler 1:4), outer link emulated
    at 100 Mbit/s, batch 8 x 128 tokens a rank. diloco, edit and aedit use the same outer
    optimizer, plain averaging (--outer-lr 1 --outer-momentum 0; --a-outer-lr/--a-outer-momentum
    change it): on a run this short, DiLoCo's 0.7/0.9 Nesterov costs local SGD 6-8% of
    validation loss against ddp (measured; see RESULTS.md). ddp, diloco and edit train
    --steps N (the same tokens); aedit runs twice:
    "aedit" with --steps N (its replicas together do 2N inner steps: the same tokens, so its
    loss compares at equal tokens) and "aedit@ddp-time" with --time-budget set to ddp's wall
    time (the same wall-clock budget: how far it gets in the time ddp needs). Prints tokens/s
    and final validation loss of each. Goals: aedit >= 2x ddp's tokens/s; aedit's validation
    loss within 3% of ddp's at equal tokens.
(b) spikes. R=2, S=1, batch 4 x 128, default outer optimizer (0.7, Nesterov 0.9), no
    straggler, no link limit; after step C replica 1's parameters get
    Gaussian noise of SCALE x their RMS (--corrupt 1:C:SCALE), a few steps before a sync. Both
    runs evaluate every 5 steps on the same held-out batches. The spike is the largest rise of
    the replicas' mean validation loss above its value at the last evaluation before the
    corruption, over the evaluations after the first sync that follows it (before that sync
    both algorithms hold the same corrupted replica; what differs is what the sync spreads to
    everyone). Validation loss, not training loss: one training batch's loss varies by +-0.3
    nats, which would drown the effect. Goal: edit's spike <= 1/5 of diloco's.

    python benchmarks/stragglers_and_spikes.py [--model micro] [--steps 120] [--only a|b]
        [--edit-flags '--edit-penalty reference ...'] [--json out.json]

Each figure is followed by PASS or MISS; misses are printed, not hidden. ~6-10 minutes on a
2-core machine (the runs are timed: a busy machine slows ddp and diloco most).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import describe  # benchmarks/machine.py

from lowband import recipes

_WORKER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_RUN_ID", "LOWBAND_WORKER")


def _die_with_parent() -> None:
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def train(run_dir: Path, args: list[str], timeout: float) -> dict:
    """`lowband train ARGS` into run_dir; returns its summary plus the events' loss curves."""
    cmd = [sys.executable, "-m", "lowband.cli", "train", "--no-progress", "--overwrite", "--run-dir",
           str(run_dir), *map(str, args)]
    env = {k: v for k, v in os.environ.items() if k not in _WORKER_ENV}
    t0 = time.time()
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            proc.wait()
            code = -1
    if code != 0:
        raise RuntimeError(f"`{shlex.join(cmd)}` failed (status {code}); see {run_dir}.log")
    from lowband.telemetry import read_events

    s = json.loads((run_dir / "summary.json").read_text())
    events = read_events(run_dir)
    steps = [e for e in events if e["kind"] == "step"]
    evals = {}
    for e in events:
        if e["kind"] == "eval":
            evals.setdefault(e["step"], []).append(e["val_loss"])
    syncs = [e for e in events if e["kind"] == "sync" and e["rank"] == 0]
    per_rank = {r: max((e["step"] for e in steps if e["rank"] == r), default=0) for r in (0, 1)}
    loss = {}
    for e in steps:
        loss.setdefault(e["step"], []).append(e["loss"])
    return {"tokens_per_s": s["tokens_per_s"], "tokens": s["tokens"], "wall_s": s["wall_s"],
            "final_val_loss": s["final_val_loss"], "outer_wire_bytes": s["outer_wire_bytes"],
            "steps_per_replica": [per_rank[0], per_rank[1]],
            "mean_loss": {k: statistics.fmean(v) for k, v in sorted(loss.items()) if len(v) == 2},
            "mean_val_loss": {k: statistics.fmean(v) for k, v in sorted(evals.items()) if len(v) == 2},
            "sync_steps": sorted({e["step"] for e in syncs}),
            "flagged": sorted({(e["step"], str(e.get("block", e.get("fragment")))) for e in syncs
                               if e.get("flagged")}),
            "median_compute_s": statistics.median(e["compute_s"] for e in steps),
            "run_s": time.time() - t0, "command": shlex.join(cmd), "run_dir": str(run_dir)}


def common(a, batch_size: int) -> list:
    return ["--replicas", 2, "--shards", 1, "--model", a.model, "--batch-size", batch_size,
            "--seq-len", a.seq_len, "--seed", a.seed, "--eval-every", 0, "--eval-batches", 8]


def part_a(a, out: Path) -> dict:
    """Each row starts from its recipe (lowband.recipes.stragglers_NAME); flags give this run's
    values (whose defaults are the recipes')."""
    link = [*common(a, a.batch_size), "--link-bandwidth", f"{a.rate_mbit:g}Mbit", "--straggler", "1:4"]
    outer = ["--outer-lr", a.a_outer_lr, "--outer-momentum", a.a_outer_momentum]
    algos = {
        "ddp": ["--recipe", "stragglers_ddp"],
        "diloco": ["--recipe", "stragglers_diloco", "--sync-every", a.sync_every, *outer],
        "edit": ["--recipe", "stragglers_edit", "--sync-every", a.sync_every, *outer,
                 *shlex.split(a.edit_flags)],
        "aedit": ["--recipe", "stragglers_aedit", "--sync-seconds", a.sync_seconds, *outer,
                  *shlex.split(a.edit_flags)],
    }
    res = {}
    for name, flags in algos.items():
        res[name] = r = train(out / f"a-{name}", [*link, *flags, "--steps", a.steps], a.timeout)
        report_a(name, r)
    budget = res["ddp"]["wall_s"]
    r = train(out / "a-aedit-time", [*link, *algos["aedit"], "--steps", 50 * a.steps,
                                      "--time-budget", f"{budget:.1f}"], a.timeout)
    res["aedit@ddp-time"] = r
    report_a("aedit@ddp-time", r)
    return res


def report_a(name: str, r: dict) -> None:
    print(f"  {name:>15}: {r['tokens_per_s']:8,.0f} tokens/s, {r['tokens']:>9,} tokens in "
          f"{r['wall_s']:6.1f} s, steps per replica {r['steps_per_replica']}, val loss "
          f"{r['final_val_loss']:.4f}, outer {r['outer_wire_bytes'] / 1e6:7.1f} MB "
          f"(median compute {1000 * r['median_compute_s']:.0f} ms/step)", flush=True)


def spike(r: dict, corrupt_step: int) -> tuple[float, int]:
    val = r["mean_val_loss"]
    before = val[max(s for s in val if s <= corrupt_step)]
    after_sync = min(s for s in r["sync_steps"] if s >= corrupt_step)
    rises = [v - before for s, v in val.items() if s > after_sync]
    return max(max(rises), 0.0), after_sync


def part_b(a, out: Path) -> dict:
    corrupt = f"1:{a.corrupt_step}:{a.corrupt_scale:g}"
    res = {}
    for name in ("diloco", "edit"):
        flags = [*common(a, a.spike_batch_size), "--algo", name, "--sync-every", a.sync_every,
                 "--steps", a.steps, "--corrupt", corrupt, "--eval-every", 5, "--link-bandwidth", "none",
                 *(shlex.split(a.edit_flags) if name == "edit" else [])]
        res[name] = r = train(out / f"b-{name}", flags, a.timeout)
        r["spike"], r["absorbed_at"] = spike(r, a.corrupt_step)
        flagged = f", flagged (step, block): {r['flagged']}" if r["flagged"] else ""
        print(f"  {name:>6}: largest rise of the mean val loss after the sync of step "
              f"{r['absorbed_at']}: {r['spike']:.4f}; val loss by step "
              f"{ {s: round(v, 3) for s, v in r['mean_val_loss'].items() if s >= a.corrupt_step - 10} }; "
              f"final {r['final_val_loss']:.4f}{flagged}", flush=True)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    base, outer = recipes.stragglers_diloco(), recipes.stragglers_aedit()  # the defaults below
    p.add_argument("--model", default=base.model)
    p.add_argument("--steps", type=int, default=base.steps, help="steps of ddp/diloco/edit; aedit's --steps")
    p.add_argument("--sync-every", type=int, default=base.sync_every, help="H of diloco and edit")
    p.add_argument("--sync-seconds", type=float, default=outer.sync_seconds, help="aedit's window")
    p.add_argument("--batch-size", type=int, default=base.batch_size, help="(a): sequences a rank per step")
    p.add_argument("--spike-batch-size", type=int, default=4, help="(b): sequences a rank per step")
    p.add_argument("--a-outer-lr", type=float, default=base.outer_lr, help="(a): outer lr of diloco/edit/aedit")
    p.add_argument("--a-outer-momentum", type=float, default=base.outer_momentum, help="(a): their outer momentum")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate-mbit", type=float, default=100.0)
    p.add_argument("--corrupt-step", type=int, default=77, help="(b): corrupted after this step")
    p.add_argument("--corrupt-scale", type=float, default=1.0)
    p.add_argument("--only", choices=("a", "b"), default=None)
    p.add_argument("--edit-flags", default="", help="more flags for the edit and aedit runs, e.g. "
                   "'--edit-penalty reference --edit-ewma-rate 0.02 --edit-temperature 1'")
    p.add_argument("--out-dir", default="")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    out = Path(a.out_dir or tempfile.mkdtemp(prefix="lowband-stragglers-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    from lowband.data import load_tokens

    load_tokens("builtin")
    t0 = time.time()
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"machine: {describe(load=True)}")
    print(f"settings: R=2 S=1, model {a.model}, {a.seq_len}-token sequences, {a.steps} steps, "
          f"H={a.sync_every}; (a) batch {a.batch_size}, aedit every {a.sync_seconds:g} s, outer "
          f"lr {a.a_outer_lr:g} momentum {a.a_outer_momentum:g}; (b) batch {a.spike_batch_size}; "
          f"runs in {out}", flush=True)
    results, goals = {}, []
    if a.only in (None, "a"):
        print(f"(a) replica 1 4x slow, link {a.rate_mbit:g} Mbit/s:")
        ra = results["a"] = part_a(a, out)
        ratio = ra["aedit"]["tokens_per_s"] / ra["ddp"]["tokens_per_s"]
        goals.append((ratio >= 2, f"aedit {ra['aedit']['tokens_per_s']:,.0f} tokens/s = {ratio:.2f}x "
                      f"ddp's {ra['ddp']['tokens_per_s']:,.0f} (goal >= 2x)"))
        rel = ra["aedit"]["final_val_loss"] / ra["ddp"]["final_val_loss"] - 1
        goals.append((rel <= 0.03, f"aedit val loss {ra['aedit']['final_val_loss']:.4f} vs ddp "
                      f"{ra['ddp']['final_val_loss']:.4f} at equal tokens ({ra['aedit']['tokens']:,} "
                      f"vs {ra['ddp']['tokens']:,}): {100 * rel:+.2f}% (goal <= +3%)"))
    if a.only in (None, "b"):
        print(f"(b) replica 1 corrupted after step {a.corrupt_step} (noise {a.corrupt_scale:g} x RMS):")
        rb = results["b"] = part_b(a, out)
        d, e = rb["diloco"]["spike"], rb["edit"]["spike"]
        ratio = e / d if d > 0 else float("inf")
        goals.append((ratio <= 0.2, f"edit's loss spike {e:.4f} = {ratio:.3f}x diloco's {d:.4f} "
                      "(goal <= 1/5)"))
    print()
    for ok, text in goals:
        print(f"{'PASS' if ok else 'MISS'}  {text}")
    print(f"({time.time() - t0:.0f} s)")
    if a.json:
        Path(a.json).write_text(json.dumps({"results": results, "goals": [
            {"pass": ok, "text": t} for ok, t in goals]}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
