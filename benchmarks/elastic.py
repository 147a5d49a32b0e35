"""Elastic replica groups against stop-and-resume, under the same failure schedule.

Streaming (fp4, tau 1) over the emulated 100 Mbit/s link, R replica groups; group 1 is killed
(SIGKILL of all its ranks, `--kill`) every --failure-every seconds of training. Three runs of the
same steps, side by side in one invocation:
  clean     --elastic, no failure: the reference for the validation loss
  elastic   --elastic with the kills: the others train on, the killed group is restarted and
            heals from a live peer at their next sync
  resume    the plain job with --checkpoint-every H and the same kills: every kill stops the
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
            "--eval-every", 0, "--eval-batches", 8, "--no-progress", "--overwrite"]


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def calibrate(a, root: Path) -> float:
    """Seconds a step of training takes here (elastic, no failure, a short run)."""
    steps = 2 * a.sync_every
    _, proc = lowband(*common(a), "--steps", steps, "--elastic", "--run-dir", root / "calibrate")
    if proc.returncode:
        sys.exit(proc.stderr)
    return summary(root / "calibrate")["wall_s"] / steps


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
    p.add_argument("--json", default="")
    a = p.parse_args()
    print(describe())
    root = Path(tempfile.mkdtemp(prefix="lowband-elastic-"))
    step_s = calibrate(a, root)
    every = max(round(a.failure_every / step_s), 2)
    steps = a.sync_every * -(-every * (a.failures + 1) // a.sync_every)
    kills = [every * (i + 1) + a.sync_every // 3 for i in range(a.failures)]  # between syncs
    kill = ",".join(f"1:{k}" for k in kills)
    tokens_per_step = a.batch_size * a.seq_len
    print(f"settings: streaming R={a.replicas} {a.model}, H={a.sync_every} P={a.fragments} tau=1 "
          f"fp4, emulated 100 Mbit/s; {step_s * 1e3:.0f} ms a step here, so one kill of group 1 "
          f"every {every} steps (~{a.failure_every:g} s) at steps {kills}, {steps} steps in all",
          flush=True)

    rows = {}
    wall, proc = lowband(*common(a), "--steps", steps, "--elastic", "--run-dir", root / "clean")
    assert proc.returncode == 0, proc.stderr
    rows["clean"] = dict(wall=wall, summary=summary(root / "clean"))
    print(f"  clean    {wall:7.1f} s", flush=True)

    wall, proc = lowband(*common(a), "--steps", steps, "--elastic", "--kill", kill,
                         "--max-restarts", a.failures, "--run-dir", root / "elastic")
    assert proc.returncode == 0, proc.stderr
    s = summary(root / "elastic")
    lost = lost_tokens(root / "elastic", 1, tokens_per_step)
    rows["elastic"] = dict(wall=wall, summary=s, useful_tokens=s["tokens"] - lost, lost=lost)
    print(f"  elastic  {wall:7.1f} s ({lost:,} tokens lost by the killed group)", flush=True)

    total, attempts = 0.0, 0
    args = [*common(a), "--steps", steps, "--kill", kill, "--checkpoint-every", a.sync_every,
            "--run-dir", root / "resume"]
    while True:
        wall, proc = lowband(*args)
        total, attempts = total + wall, attempts + 1
        if proc.returncode == 0:
            break
        if attempts > a.failures + 1:
            sys.exit(f"resume: attempt {attempts} failed: {proc.stderr[-2000:]}")
        args = ["--resume", root / "resume"]  # its own config: the kills already done stay done
    s = summary(root / "resume")
    rows["resume"] = dict(wall=total, summary=s, useful_tokens=s["tokens"], attempts=attempts)
    print(f"  resume   {total:7.1f} s over {attempts} attempts", flush=True)

    good = {k: r.get("useful_tokens", r["summary"]["tokens"]) / r["wall"] for k, r in rows.items()}
    ratio = good["elastic"] / good["resume"]
    heals = [e for e in read_events(root / "elastic", ("membership",)) if e["healed"]]
    starts = [e for e in read_events(root / "elastic", ("run",)) if e["replica"] == 1 and e["phase"] == "start"]
    steps1 = [e for e in read_events(root / "elastic", ("step",)) if e["replica"] == 1]
    rejoin = []
    for start in starts[1:]:  # each restart: from its start event to its first step after healing
        first = next((e for e in steps1 if e["t"] > start["t"]), None)
        if first is not None:
            rejoin.append(first["t"] - start["t"])
    val = {k: r["summary"]["final_val_loss"] for k, r in rows.items()}
    print("\ngoodput (tokens in the model / job wall seconds):")
    for k, r in rows.items():
        print(f"  {k:8s} {good[k]:8.0f} tokens/s  (val loss {val[k]:.4f})")
    print(f"  elastic / resume = {ratio:.2f}x  (goal >= 1.5x)  {'PASS' if ratio >= 1.5 else 'MISS'}")
    if rejoin:
        print(f"restart -> first step after healing: {', '.join(f'{x:.1f} s' for x in rejoin)} "
              f"(heal bytes {heals[0]['heal_bytes']:,}, heal {heals[0]['heal_s'] * 1e3:.0f} ms)")
    rel = val["elastic"] / val["clean"] - 1
    print(f"validation loss elastic {val['elastic']:.4f} vs clean {val['clean']:.4f}: {rel:+.2%} "
          f"(goal within 3%)  {'PASS' if abs(rel) <= 0.03 else 'MISS'}")
    if a.json:
        Path(a.json).write_text(json.dumps({"settings": vars(a), "steps": steps, "kills": kills,
                                            "step_s": step_s, "rows": rows, "goodput": good,
                                            "ratio": ratio, "rejoin_s": rejoin}, indent=1))
    print(f"runs in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
