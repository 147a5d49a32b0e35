"""How close is `lowband plan` to the runs it plans? A sweep of real streaming runs.

Each point is a real `lowband train --algo streaming` run on the emulated outer link
(--link-bandwidth, --link-latency: comm/link.py) of lowband's nano preset with 4 blocks
(embeddings and tied head in fragment 0), H=20, P=4, tau=1, over bandwidths x codecs x
replicas. Each run's compute time per step is measured (the mean of its `step` events'
compute_s, every step and rank: the plan then computes as long as the run did), and the plan of
the run's own config (lowband.plan.check_run: lowband.plan.plan_config over the whole run,
fragments split as the run split them, exact codec bytes, the exchange lowband takes for R
replicas) is set beside the run's measured compute utilization. Prints a table, the largest
planned transfer beside the largest one sent, and the largest miss in CU points (goal <= 10).
The runs go one after another (they would share the cores otherwise).

"peer wait" is what the plan does not model (its replicas are identical and in lockstep): the
time collectives went on after the emulated link had delivered their bytes, waiting for a peer
replica that started late, per replica, as a share of the run's wall time. On 2 cores R=4 runs
4 processes, and any other load on the machine shows up here first. "miss less peer wait"
sets the plan against measured CU / (1 - peer wait), the run as if no peer had come late.

    python benchmarks/plan_accuracy.py [--quick] [--steps 60] [--latency 20ms]
        [--bandwidth 2Mbit 5Mbit 20Mbit] [--codec fp32 fp4-e3m0 topk-2bit] [--replicas 2 4]
        [--keep DIR] [--json out.json]

--quick: 5 and 20 Mbit/s, fp32 and fp4-e3m0, R=2 and 4, 40 steps (8 runs, ~2 minutes).
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

from lowband.comm.codecs import CODECS
from lowband.plan import check_run
from lowband.telemetry import RunDir, read_events
from lowband.units import parse_bandwidth, parse_duration

RUN = ["--algo", "streaming", "--model", "nano", "--n-layer", "4", "--sync-every", "20",
       "--fragments", "4", "--overlap", "1", "--eval-every", "0", "--no-progress"]


def run_point(root: Path, bw: str, codec: str, replicas: int, a) -> dict:
    """Train one point of the sweep and check it against the plan."""
    run = root / f"{codec}-{bw}-r{replicas}"
    cmd = [sys.executable, "-m", "lowband.cli", "train", *RUN, "--codec", codec,
           "--replicas", str(replicas), "--steps", str(a.steps), "--link-bandwidth", bw,
           "--link-latency", a.latency, "--run-dir", str(run)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    r = check_run(run, warmup_steps=0)
    comms = [e for e in read_events(RunDir(run), ("comm",)) if e["group"] == "outer"]
    exchange = {"all_to_all": "two-phase", "all_reduce": "all-reduce"}
    how = next((exchange[op] for op in exchange if op in {e["op"] for e in comms}), "all-gather")
    # what the plan cannot know: a collective that ends after the link delivered its bytes waited
    # for a peer replica that came late (its compute slower, or its process descheduled)
    bits, latency = parse_bandwidth(bw), parse_duration(a.latency)
    late = sum(max(0.0, e["end"] - e["begin"] - 8 * e["wire_bytes"] / bits - latency)
               for e in comms) / replicas
    wall = json.loads((run / "summary.json").read_text())["wall_s"]
    lockstep = min(1.0, r["measured_cu"] / (1 - late / wall))  # had no peer come late
    return r | {"link": bw, "codec": codec, "replicas": replicas, "exchange": how,
                "miss": r["predicted_cu"] - r["measured_cu"], "peer_wait": late / wall,
                "lockstep_miss": r["predicted_cu"] - lockstep}


def table(rows: list[dict]) -> str:
    head = ("link", "codec", "R", "exchange", "step ms", "measured", "predicted", "miss pp",
            "largest planned", "largest sent", "peer wait", "miss less peer wait")
    body = [(r["link"], r["codec"], str(r["replicas"]), r["exchange"],
             f"{1e3 * r['step_time']:.1f}", f"{r['measured_cu']:.3f}", f"{r['predicted_cu']:.3f}",
             f"{100 * r['miss']:+.1f}", f"{r['planned_peak_transfer_bytes']:,.0f} B",
             f"{r['sent_peak_transfer_bytes']:,} B", f"{r['peer_wait']:.1%}",
             f"{100 * r['lockstep_miss']:+.1f}") for r in rows]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small sweep (8 runs, 40 steps)")
    p.add_argument("--steps", type=int, default=None, help="steps a run (default 60; quick 40)")
    p.add_argument("--latency", default="20ms")
    p.add_argument("--bandwidth", nargs="+", default=None)
    p.add_argument("--codec", nargs="+", default=None)
    p.add_argument("--replicas", nargs="+", type=int, default=None)
    p.add_argument("--keep", help="keep the run directories here (default: a temporary one)")
    p.add_argument("--json", help="write the rows and the machine here")
    a = p.parse_args(argv)
    quick = a.quick  # the defaults of the sweep
    a.steps = a.steps or (40 if quick else 60)
    a.bandwidth = a.bandwidth or (["5Mbit", "20Mbit"] if quick else ["2Mbit", "5Mbit", "20Mbit"])
    sparse = [c for c in ("topk-2bit",) if c in CODECS]  # where lowband has it
    a.codec = a.codec or (["fp32", "fp4-e3m0"] + ([] if quick else sparse))
    a.replicas = a.replicas or [2, 4]
    machine, start = describe(load=True), time.time()
    root = Path(a.keep or tempfile.mkdtemp(prefix="lowband-plan-accuracy-"))
    root.mkdir(parents=True, exist_ok=True)
    rows = [run_point(root, bw, codec, R, a)
            for R in a.replicas for codec in a.codec for bw in a.bandwidth]
    worst = max(rows, key=lambda r: abs(r["miss"]))
    seconds = round(time.time() - start)
    print(f"streaming on nano (4 blocks, H=20 P=4 tau=1), {a.steps} steps a run, link latency "
          f"{a.latency}; {machine}; {seconds} s")
    print(table(rows))
    print(f"largest miss: {100 * abs(worst['miss']):.1f} CU points ({worst['codec']}, "
          f"{worst['link']}, R={worst['replicas']}) (goal <= 10): "
          f"{'PASS' if abs(worst['miss']) <= 0.10 else 'MISS'}")
    lockstep = max(abs(r["lockstep_miss"]) for r in rows)
    print(f"less the waits for late peers (measured CU / (1 - peer wait)): largest miss "
          f"{100 * lockstep:.1f} points")
    if a.json:
        out = {"machine": machine, "steps": a.steps, "latency": a.latency, "seconds": seconds,
               "rows": rows}
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
