"""Sites that differ: with one replica slower, which setup reaches ddp's loss soonest, and how
close does adaptive streaming come to the ideal?

`lowband compare` on the main job's emulated link (100 Mbit/s, 10 ms), every run one after
another with the machine to itself, at ddp's wall-clock time (each run gets ddp's measured
training seconds as --time-budget):

  homo   R replicas of equal speed: ddp (the reference) and streaming with fixed local steps
  slow   the same replicas with replica 1 computing FACTOR x slower (--straggler 1:FACTOR; or
         slowed now and then, --slowdown 1:FACTOR:SECONDS:GAP):
         ddp, streaming (fixed local steps), streaming --local-steps adaptive, diloco
         --local-steps adaptive, and aedit

The target is ddp's final validation loss (the straggler only sleeps, so ddp's runs train the
same steps to the same loss). The ideal under heterogeneity is the homogeneous streaming run's
time to target x R / (sum of the replicas' speeds), the speeds being 1 and 1/FACTOR: what the
compute that is left would give if none of it waited. Printed per run: time to target (and its
ratio to the ideal), validation loss at equal time, tokens/s, compute utilization (the mean,
and each replica's: its ranks' compute seconds over their training seconds), then PASS/MISS
per goal of issue 43:
  1. adaptive streaming's time to target within 1.15x of the ideal
  2. every replica of adaptive streaming at >= 95% compute utilization
  3. adaptive streaming reaches ddp's loss sooner than fixed streaming and sooner than aedit
  4. (homo) nothing to compare: adaptive is tested equal to fixed in tests/test_local_steps.py

    python benchmarks/heterogeneity.py [--model micro] [--replicas 2] [--factor 2]
        [--steps 100] [--slowdown 1:3:5:10] [--dir DIR] [--json out.json]

A part's runs land in DIR/<part>/ (default: a fresh temporary directory); calling again with the
same --dir continues (lowband compare skips finished runs). R=2, micro, 100 steps: about 5
minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "toolkit"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lowband  # noqa: E402
from goals import report  # noqa: E402
from lowband.compare.table import text  # noqa: E402

LINK = ["--link-bandwidth", "100Mbit", "--link-latency", "10ms"]
ADAPTIVE = {"local_steps": "adaptive"}
PARTS = {  # runs are named by algorithm, a second of the same algorithm NAME-2
    "homo": [("ddp", {}), ("streaming", {})],
    "slow": [("ddp", {}), ("streaming", {}), ("streaming", ADAPTIVE), ("diloco", ADAPTIVE),
             ("aedit", {})],
}


def run_part(name: str, a, root: Path) -> dict:
    flags = ["--model", a.model, "--replicas", str(a.replicas), "--steps", str(a.steps),
             "--eval-every", str(a.eval_every), *LINK]
    if name == "slow":
        flags += ["--slowdown", a.slowdown] if a.slowdown else ["--straggler", f"1:{a.factor:g}"]
    t0 = time.time()
    result = lowband.compare(algos=PARTS[name], flags=flags, directory=root / name)
    print(f"\n[{name}] {time.time() - t0:.0f} s; report: {root / name / 'report.html'}", flush=True)
    print(text(result), flush=True)
    return result


def mean_speed(a) -> float:
    """Replica 1's speed on average: 1/FACTOR, or with --slowdown REPLICA:FACTOR:SECONDS:GAP
    slowed for SECONDS of every SECONDS + GAP on average."""
    if not a.slowdown:
        return 1 / a.factor
    _, factor, seconds, gap = (float(x) for x in a.slowdown.split(":"))
    slowed = seconds / (seconds + gap)
    return (1 - slowed) + slowed / factor


def reached_s(row: dict) -> float | None:
    return row["target"].get("elapsed_s") if row["target"].get("reached") else None


def goals(homo: dict, slow: dict, a) -> list[tuple[str, bool | None, str]]:
    rows = {r["name"]: r for r in slow["runs"]}
    t_homo = reached_s({r["name"]: r for r in homo["runs"]}["streaming"])
    speeds = [1.0] * a.replicas
    speeds[1] = mean_speed(a)
    ideal = None if t_homo is None else t_homo * a.replicas / sum(speeds)
    t = {name: reached_s(r) for name, r in rows.items()}
    out = []
    ad = t.get("streaming-2")
    ratio = None if ad is None or ideal is None else ad / ideal
    out.append(("adaptive streaming's time to target within 1.15x of the ideal",
                None if ratio is None else ratio <= 1.15,
                f"{ad} s against the ideal {ideal and round(ideal, 2)} s"
                + ("" if ratio is None else f" ({ratio:.2f}x)")))
    cus = rows["streaming-2"]["replica_compute_utilization"]  # (compare's, from the run model)
    out.append(("every replica of adaptive streaming at >= 95% compute utilization",
                min(cus) >= 0.95, ", ".join(f"{c:.1%}" for c in cus)))
    for other, what in (("streaming", "fixed streaming"), ("aedit", "aedit")):
        o = t.get(other)
        ok = None if ad is None else (o is None or ad < o)
        out.append((f"adaptive streaming sooner than {what}", ok, f"{ad} s against {o} s"))
    for name, r in rows.items():
        out.append((f"{name}: per replica CU", None, ", ".join(
            f"{c:.1%}" for c in r["replica_compute_utilization"])))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="micro")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--factor", type=float, default=2.0)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=20)  # (diloco adaptive: syncs only)
    p.add_argument("--slowdown", default="", help="1:FACTOR:SECONDS:GAP: replica 1 slowed now "
                   "and then (--slowdown) in place of the --straggler of --factor")
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    root = a.dir or Path(tempfile.mkdtemp(prefix="lowband-heterogeneity-"))
    results = {name: run_part(name, a, root) for name in ("homo", "slow")}
    how = f"--slowdown {a.slowdown}" if a.slowdown else f"{a.factor:g}x slower"
    report(f"goals (R={a.replicas}, {a.model}, replica 1 {how})",
           goals(results["homo"], results["slow"], a), a, a.json, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
