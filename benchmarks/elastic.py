"""Elastic replica groups against stop-and-resume, under the same failure schedule.

Streaming (fp4, tau 1) over the emulated 100 Mbit/s link, R replica groups; group 1 is killed
(SIGKILL of all its ranks, `--kill`) every --failure-every seconds of training. Three runs of the
same steps, side by side in one invocation:
  clean     --elastic, no failure: the reference for the validation loss
  elastic   --elastic with the kills: the others train on, the killed group is restarted and
            heals from a live peer at their next sync
  resume    the plain job with the same kills, checkpointing at Young's optimum interval
            (sqrt(2 x measured checkpoint cost x time between failures)): every kill stops the
            whole job, which is started again with --resume from its last checkpoint
Goodput = tokens of work that ends in the model / wall seconds of the whole job (start-ups,
restarts and re-done steps included). For elastic, a killed group's steps since its last sync
never reach the model and are left out; for resume, the final summary counts exactly the steps
that survive (re-done steps count once). Prints the goodput ratio (goal >= 1.5x at one failure
per two minutes), the time from a group's restart to its first step after healing, and the
validation loss against the clean run (goal within 3%).

    python benchmarks/elastic.py [--model micro] [--replicas 3] [--failure-every 120]
        [--failures 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import describe  # benchmarks/machine.py

from lowband.telemetry import read_events

PY = sys.executable


def lowband(*args) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    proc = subprocess.run([PY, "-m", "lowband.cli", "train", *map(str, args)],
                          capture_output=True, text=True, timeout=3600)
    return time.perf_counter() - t0, proc


def common(a) -> list:
    return ["--algo", "streaming", "--model", a.model, "--replicas", a.replicas,
            "--fragments", a.fragments, "--sync-every", a.sync_every, "--overlap", 1,
            "--batch-size", a.batch_size, "--seq-len", a.seq_len, "--link-bandwidth", "100Mbit",
            "--link-latency", "0ms", "--eval-every", 0, "--eval-batches", 8, "--no-progress", "--overwrite"]


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def calibrate(a, root: Path) -> tuple[float, float]:
    """(seconds a step of training takes here, seconds a checkpoint takes), from two short runs:
    elastic without failures, and the plain job checkpointing every H steps."""
    steps = 2 * a.sync_every
    _, proc = lowband(*common(a), "--steps", steps, "--elastic", "--run-dir", root / "calibrate")
    if proc.returncode:
        sys.exit(proc.stderr)
    step_s = summary(root / "calibrate")["wall_s"] / steps
    _, proc = lowband(*common(a), "--steps", 2 * steps, "--checkpoint-every", a.sync_every,
                      "--run-dir", root / "calibrate-ckpt")
    if proc.returncode:
        sys.exit(proc.stderr)
    events = [e for e in read_events(root / "calibrate-ckpt", ("step", "checkpoint")) if e["rank"] == 0]
    at = {e["step"]: e["t"] for e in events if e["kind"] == "step"}
    costs = [e["t"] - at[e["step"]] for e in events if e["kind"] == "checkpoint"]
    return step_s, sorted(costs)[len(costs) // 2]


def lost_tokens(run: Path, replica: int, tokens_per_step: int) -> int:
    """Tokens a killed group trained after its last sync in each life that ended in a kill (its
    pseudo-gradient never left, so that work is not in the model). S=1: the group's rank is its
    replica index; its lives begin at its `run` start events."""
    mine = lambda kind: [e for e in read_events(run, (kind,)) if e["rank"] == replica]  # noqa: E731
    starts = [e["t"] for e in mine("run") if e["phase"] == "start"]
    syncs = {e["step"] for e in mine("sync")}
    lost = 0
    for begin, end in zip(starts, starts[1:]):  # every life but the last ended in a kill
        steps = [e["step"] for e in mine("step") if begin <= e["t"] < end]
        if steps:
            lost += (steps[-1] - max([x for x in syncs if x <= steps[-1]] or [0])) * tokens_per_step
    return lost


def run_all(a, root: Path) -> dict:
    """The three jobs, each timed around its whole life; the settings they used."""
    step_s, ckpt_s = calibrate(a, root)
    every = max(round(a.failure_every / step_s), 2)
    # the baseline checkpoints at Young's optimum, sqrt(2 x checkpoint cost x time between
    # failures), in whole rounds of H: stop-and-resume at its best
    young = (2 * ckpt_s * a.failure_every) ** 0.5 / step_s
    interval = a.checkpoint_every or max(a.sync_every, a.sync_every * round(young / a.sync_every))
    steps = a.sync_every * -(-every * (a.failures + 1) // a.sync_every)
    kills = [every * (i + 1) + a.sync_every // 3 for i in range(a.failures)]  # between syncs
    kill = ",".join(f"1:{k}" for k in kills)
    print(f"settings: streaming R={a.replicas} {a.model}, H={a.sync_every} P={a.fragments} tau=1 "
          f"fp4, emulated 100 Mbit/s; {step_s * 1e3:.0f} ms a step here, so one kill of group 1 "
          f"every {every} steps (~{a.failure_every:g} s) at steps {kills}, {steps} steps in all; "
          f"a checkpoint takes {ckpt_s * 1e3:.0f} ms, so the resume baseline checkpoints every "
          f"{interval} steps", flush=True)
    rows = {}
    wall, proc = lowband(*common(a), "--steps", steps, "--elastic", "--run-dir", root / "clean")
    assert proc.returncode == 0, proc.stderr
    rows["clean"] = dict(wall=wall)
    print(f"  clean    {wall:7.1f} s", flush=True)
    wall, proc = lowband(*common(a), "--steps", steps, "--elastic", "--kill", kill,
                         "--max-restarts", a.failures, "--run-dir", root / "elastic")
    assert proc.returncode == 0, proc.stderr
    rows["elastic"] = dict(wall=wall)
    print(f"  elastic  {wall:7.1f} s", flush=True)
    total, attempts = 0.0, 0
    args = [*common(a), "--steps", steps, "--kill", kill, "--checkpoint-every", interval,
            "--run-dir", root / "resume"]
    while True:
        wall, proc = lowband(*args)
        total, attempts = total + wall, attempts + 1
        if proc.returncode == 0:
            break
        if attempts > a.failures + 1:
            sys.exit(f"resume: attempt {attempts} failed: {proc.stderr[-2000:]}")
        args = ["--resume", root / "resume"]  # its own config: the kills already done stay done
    rows["resume"] = dict(wall=total, attempts=attempts)
    print(f"  resume   {total:7.1f} s over {attempts} attempts", flush=True)
    return {"root": str(root), "steps": steps, "kills": kills, "step_s": step_s,
            "checkpoint_s": ckpt_s, "checkpoint_every": interval, "rows": rows}


def analyze(result: dict, tokens_per_step: int) -> dict:
    """Goodput, rejoin times and losses of the three runs (walls measured around each job:
    start-ups, restarts and re-done steps included)."""
    root, rows = Path(result["root"]), result["rows"]
    for name, r in rows.items():
        r["summary"] = summary(root / name)
    # work in the model: resume's summary counts the steps that survive (re-done ones once);
    # elastic's counts only each group's last life, so every life's steps come from the events,
    # less what the killed group trained after its last sync in each life
    ran = len(read_events(root / "elastic", ("step",))) * tokens_per_step
    lost = lost_tokens(root / "elastic", 1, tokens_per_step)
    rows["elastic"].update(useful_tokens=ran - lost, lost=lost)
    for name in ("clean", "resume"):
        rows[name]["useful_tokens"] = rows[name]["summary"]["tokens"]
    good = {k: r["useful_tokens"] / r["wall"] for k, r in rows.items()}
    ratio = good["elastic"] / good["resume"]
    heals = [e for e in read_events(root / "elastic", ("membership",)) if e["healed"]]
    steps1 = [e for e in read_events(root / "elastic", ("step",)) if e["replica"] == 1]
    starts = [e["t"] for e in read_events(root / "elastic", ("run",))
              if e["replica"] == 1 and e["phase"] == "start"]
    rejoin = []  # (restart -> first step, last step before the kill -> first step after healing)
    for start in starts[1:]:
        before = [e for e in steps1 if e["t"] < start]
        after = [e for e in steps1 if e["t"] > start]
        if before and after:
            rejoin.append((after[0]["t"] - start, after[0]["t"] - before[-1]["t"]))
    val = {k: r["summary"]["final_val_loss"] for k, r in rows.items()}
    print("\ngoodput (tokens in the model / job wall seconds):")
    for k, r in rows.items():
        print(f"  {k:8s} {good[k]:8.0f} tokens/s  ({r['useful_tokens']:,} tokens in "
              f"{r['wall']:.1f} s; val loss {val[k]:.4f})")
    print(f"  elastic / resume = {ratio:.2f}x  (goal >= 1.5x)  {'PASS' if ratio >= 1.5 else 'MISS'}"
          f"  [elastic lost {lost:,} tokens of the killed group; resume took "
          f"{rows['resume']['attempts']} attempts]")
    for (from_start, from_kill), heal in zip(rejoin, heals):
        print(f"restart -> first step after healing {from_start:.1f} s (last step before the kill "
              f"-> first after healing {from_kill:.1f} s); healed {heal['heal_bytes']:,} bytes "
              f"for step {heal['step']}, loaded in {heal['heal_s'] * 1e3:.0f} ms")
    rel = val["elastic"] / val["clean"] - 1
    print(f"validation loss elastic {val['elastic']:.4f} vs clean {val['clean']:.4f}: {rel:+.2%} "
          f"(goal within 3%)  {'PASS' if abs(rel) <= 0.03 else 'MISS'}")
    return {**result, "goodput": good, "ratio": ratio, "rejoin_s": rejoin}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="micro")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--fragments", type=int, default=2)
    p.add_argument("--sync-every", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--failure-every", type=float, default=120.0, help="seconds of training between kills")
    p.add_argument("--failures", type=int, default=2)
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="the baseline's checkpoint interval (0: Young's optimum, measured)")
    p.add_argument("--reanalyze", default="", help="a JSON this script wrote: analyze its runs again")
    p.add_argument("--json", default="")
    a = p.parse_args()
    print(describe())
    if a.reanalyze:
        result = json.loads(Path(a.reanalyze).read_text())
    else:
        result = run_all(a, Path(tempfile.mkdtemp(prefix="lowband-elastic-")))
    result = analyze(result, a.batch_size * a.seq_len)
    if a.json:
        Path(a.json).write_text(json.dumps({"settings": vars(a), **result}, indent=1))
    print(f"runs in {result['root']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
