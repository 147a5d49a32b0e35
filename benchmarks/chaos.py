"""The chaos soak (issue 32): 8 elastic replica groups of a tiny model on loopback, a random
group SIGKILLed about every 15 s and the Lighthouse killed once, for about --seconds of wall
time; then the invariants from the run's own records (lowband/testing/chaos.py) and its
validation loss against the same run without failures at equal tokens (goal within 3%).

The run is bounded by steps (an elastic run takes no --time-budget): unless --steps is given,
a short run without faults measures this machine's steps a second first.

    python benchmarks/chaos.py [--seconds 600] [--seed 0] [--replicas 8] [--kill-every 15]
        [--steps N] [--out DIR] [--recheck ROOT]

Prints the faults as they happen, the invariants checked (each broken one by name), and the
figures: kills, restarts, heals, Lighthouse restarts, participants per sync, loss against the
reference. DIR keeps the runs' terminal output, their summary.json and chaos.json (faults,
checks, figures); the runs stay in a temporary folder the last line names. Exit status 1 when
an invariant or the loss goal failed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from lowband.telemetry import read_events
from lowband.testing.chaos import Fault, Soak, check, compare, train_argv


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--kill-every", type=float, default=15.0)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--tolerance", type=float, default=0.03)
    p.add_argument("--quorum-timeout", type=float, default=30.0)
    p.add_argument("--out", default=None, help="where to keep the raw output")
    p.add_argument("--recheck", default=None, metavar="ROOT",
                   help="check a kept soak again: its runs in ROOT (chaos/, reference/), its "
                        "faults in --out's chaos.json")
    a = p.parse_args(argv)
    if a.seconds <= 0 or a.kill_every <= 0 or a.replicas < 2:
        p.error("--seconds and --kill-every must be positive, --replicas at least 2")
    say = lambda text: print(text, flush=True)  # noqa: E731
    if a.recheck:
        out = Path(a.out or a.recheck)
        if not (out / "chaos.json").is_file():
            p.error(f"--recheck needs the soak's chaos.json in {out}")
        return judge(Path(a.recheck), out, json.loads((out / "chaos.json").read_text()), a, say)
    root = Path(tempfile.mkdtemp(prefix="chaos-"))
    out = Path(a.out) if a.out else root
    out.mkdir(parents=True, exist_ok=True)

    steps = a.steps or calibrate(root, a.replicas, a.seconds, say)
    eval_every = max(steps // 20, 1)
    say(f"chaos: {a.replicas} groups, {steps} steps, a kill about every {a.kill_every:g} s, "
        f"seed {a.seed}")
    soak = Soak(train_argv(root / "chaos", steps, a.replicas, quorum_timeout=a.quorum_timeout),
                seed=a.seed, kill_every=a.kill_every, lighthouse_at=a.seconds * 0.4,
                timeout=a.seconds * 4 + 300).run(say)
    (out / "chaos.out").write_text(soak.output)
    if soak.returncode != 0:
        say(f"chaos: the run ended with status {soak.returncode}:\n{soak.output[-3000:]}")
        return 1
    say("chaos: the reference run (the same flags, no faults)")
    ref = Soak(train_argv(root / "reference", steps, a.replicas, quorum_timeout=a.quorum_timeout,
                          eval_every=eval_every), kill_every=1e9, lighthouse_at=1e9,
               timeout=a.seconds * 4 + 300).run()
    (out / "reference.out").write_text(ref.output)
    if ref.returncode != 0:
        say(f"chaos: the reference run ended with status {ref.returncode}")
        return 1
    result = {"seed": a.seed, "replicas": a.replicas, "steps": steps, "chaos_wall_s": soak.wall_s,
              "reference_wall_s": ref.wall_s, "faults": [vars(f) for f in soak.faults]}
    return judge(root, out, result, a, say)


def judge(root: Path, out: Path, result: dict, a, say) -> int:
    """Check the soak in root (chaos/, reference/), print and keep (out/chaos.json) what it
    found; 1 when an invariant or the loss goal failed."""
    faults = [Fault(**f) for f in result["faults"]]
    report = check(root / "chaos", faults)
    ok, message, loss = compare(root / "chaos", root / "reference", a.tolerance)
    report.expect("5 loss", ok, message.removeprefix("5 loss: "))
    result = {k: v for k, v in result.items() if k not in ("passed", "failures", "figures")}
    result = {**result, "passed": report.passed, "failures": report.failures,
              "figures": {**report.figures, **loss}}
    (out / "chaos.json").write_text(json.dumps(result, indent=2) + "\n")
    for name in ("chaos", "reference"):
        shutil.copy(root / name / "summary.json", out / f"{name}-summary.json")
    f = result["figures"]
    say(f"chaos: {result['chaos_wall_s']:.0f} s wall, {f['kills']} group kills, "
        f"{f['lighthouse_kills']} Lighthouse kill; {f['restarts']} restarts, "
        f"{f['lighthouse_restarts']} Lighthouse restart(s), {f['heals']} heals, "
        f"{f['steps_redone']} steps redone")
    say(f"chaos: {f['syncs']} syncs, {f['mean_participants']:.2f} participants per sync on "
        f"average, {f['syncs_with_every_live_group']} with every live group")
    say(f"chaos: val loss {f['chaos_val_loss']:.4f} against "
        f"{f['reference_val_loss_at_equal_tokens']:.4f} "
        f"without failures at equal tokens ({100 * f['loss_gap']:+.2f}%, "
        f"{f['tokens_in_model']:,} of "
        f"{f['reference_tokens']:,} tokens)")
    say("chaos: checks passed: " + ", ".join(f"{k} x{n}" for k, n in sorted(report.passed.items())))
    for failure in report.failures:
        say(f"chaos: FAILED {failure}")
    say(f"chaos: raw output in {out}, the runs in {root}")
    return 1 if report.failures else 0


def calibrate(root: Path, replicas: int, seconds: float, say) -> int:
    """Steps for about `seconds` of chaos: this machine's steps a second without faults (a
    64-step run), times the seconds, less a fifth for what the faults cost."""
    run = Soak(train_argv(root / "calibrate", 64, replicas), kill_every=1e9, lighthouse_at=1e9,
               timeout=600).run()
    if run.returncode != 0:
        raise SystemExit(f"chaos: the calibration run failed:\n{run.output[-3000:]}")
    steps = [e["t"] for e in read_events(root / "calibrate", ("step",)) if e["replica"] == 0]
    rate = (len(steps) - 1) / (steps[-1] - steps[0])
    start_s = run.wall_s - (steps[-1] - steps[0])
    say(f"chaos: {rate:.1f} steps/s without faults here, {start_s:.0f} s to start")
    return max(int(rate * (seconds - start_s) * 0.8) // 16 * 16, 32)


if __name__ == "__main__":
    sys.exit(main())
