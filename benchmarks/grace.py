"""A replica that stalls: how long do the others wait with and without --grace, and what does
the late replica's work cost the model?

Streaming with adaptive local steps on the main job's emulated link (100 Mbit/s, 10 ms), R=2,
run one after another with the machine to itself:

  steady  nobody stalls
  paused  replica 1 stalls PAUSE s after inner step AT (--pause 1:AT:PAUSE), no --grace: the
          others wait for it at the next sync
  graced  the same stall with --grace GRACE: the others go on after the window; replica 1's
          work merges later (algorithms/grace.py)

Printed per run: replica 0's longest wait between two of its steps (a step's events' times:
the stall of the others), the run's training seconds, the syncs replica 1 missed, and the final
validation loss beside the steady run's at the same tokens (its evaluations, interpolated
linearly; an evaluation's loss is the mean over the replicas, as summary.json's), then
PASS/MISS per goal of issue 43:
  1. graced: replica 0 waits no longer than the grace window (plus one step's and one sync's
     own time, 0.5 s here)
  2. graced: the final loss within 1% of the steady run's at equal tokens

    python benchmarks/grace.py [--model micro] [--steps 400] [--at 60] [--pause 20]
        [--grace 2] [--dir DIR] [--json out.json]

R=2, micro, 400 steps: about 4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "toolkit"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from goals import report  # noqa: E402
from lowband.telemetry import read_events  # noqa: E402

LINK = ["--link-bandwidth", "100Mbit", "--link-latency", "10ms"]
SLACK_S = 0.5  # one step's and one sync's own time on top of the window


def run(name: str, a, root: Path, extra: list[str]) -> Path:
    out = root / name
    if not (out / "summary.json").exists():
        cmd = [sys.executable, "-c", "from lowband.cli import main; main()", "train",
               "--algo", "streaming", "--model", a.model, "--replicas", "2", "--steps",
               str(a.steps), "--eval-every", str(a.eval_every), "--local-steps", "adaptive",
               "--no-progress", *LINK, *extra, "--run-dir", str(out)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


def measure(out: Path) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    times = [e["t"] for e in read_events(out, ("step",)) if e["replica"] == 0]
    by_step: dict = {}  # an evaluation every replica took: the mean, as summary.json's
    for e in read_events(out, ("eval",)):
        if "tokens" in e:
            by_step.setdefault(e["step"], (e["tokens"], {}))[1][e["replica"]] = e["val_loss"]
    evals = [(tokens, sum(v.values()) / len(v)) for _, (tokens, v) in sorted(by_step.items())]
    missed = [e for e in read_events(out, ("sync",)) if e["replica"] == 1 and e.get("missed")]
    return {"longest_wait_s": max(b - a for a, b in zip(times, times[1:])),
            "wall_s": summary["wall_s"], "tokens": summary["tokens"],
            "steps_per_replica": summary["steps_run_per_replica"],
            "final_val_loss": summary["final_val_loss"], "missed_syncs": len(missed),
            "outer_states_agree": summary["outer_states_agree"], "evals": evals}


def at_tokens(evals: list[tuple[int, float]], tokens: int) -> float:
    """A run's validation loss at `tokens`, interpolated between its evaluations."""
    for (t0, v0), (t1, v1) in zip(evals, evals[1:]):
        if t0 <= tokens <= t1:
            return v0 + (v1 - v0) * (tokens - t0) / max(t1 - t0, 1)
    return evals[-1][1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="micro")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--at", type=int, default=62, help="the inner step replica 1 stalls after "
                   "(mid-period, away from the evaluations)")
    p.add_argument("--pause", type=float, default=20.0)
    p.add_argument("--grace", type=float, default=2.0)
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    root = a.dir or Path(tempfile.mkdtemp(prefix="lowband-grace-"))
    stall = ["--pause", f"1:{a.at}:{a.pause:g}"]
    runs = {"steady": run("steady", a, root, []),
            "paused": run("paused", a, root, stall),
            "graced": run("graced", a, root, [*stall, "--grace", f"{a.grace:g}s"])}
    got = {name: measure(out) for name, out in runs.items()}
    steady = got["steady"]["evals"]
    print(f"R=2, {a.model}, {a.steps} steps; replica 1 stalls {a.pause:g} s after step {a.at}; "
          f"runs in {root}")
    print(f"{'run':8} {'longest wait':>13} {'wall s':>8} {'missed':>7} {'val loss':>9} "
          f"{'steady at equal tokens':>23}  steps per replica")
    for name, m in got.items():
        m["steady_at_tokens"] = at_tokens(steady, m["tokens"])
        print(f"{name:8} {m['longest_wait_s']:12.2f}s {m['wall_s']:8.1f} {m['missed_syncs']:7d} "
              f"{m['final_val_loss']:9.4f} {m['steady_at_tokens']:23.4f}  "
              f"{m['steps_per_replica']}")
    g = got["graced"]
    checked = [
        ("graced: replica 0 waits no longer than the grace window",
         g["longest_wait_s"] <= a.grace + SLACK_S,
         f"{g['longest_wait_s']:.2f} s against {a.grace:g} s (+{SLACK_S} s); without --grace "
         f"{got['paused']['longest_wait_s']:.2f} s"),
        ("graced: final loss within 1% of the steady run's at equal tokens",
         abs(g["final_val_loss"] / g["steady_at_tokens"] - 1) <= 0.01,
         f"{g['final_val_loss']:.4f} against {g['steady_at_tokens']:.4f} "
         f"({g['final_val_loss'] / g['steady_at_tokens'] - 1:+.2%})"),
        ("every replica's outer state the same", all(m["outer_states_agree"]
                                                      for m in got.values()), ""),
    ]
    report("goals", checked, a, a.json, runs=got)
    return 0


if __name__ == "__main__":
    sys.exit(main())
