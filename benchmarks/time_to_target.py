"""Which setup reaches ddp's loss soonest on a slow link, measured side by side and predicted.

`lowband compare` on the emulated 100 Mbit/s, 10 ms link (the main job's), model `mini`
(4.8M parameters), every run one after another with the machine to itself:

  r2   R=2: ddp for --steps steps (the reference), then, each given ddp's measured training
       time (--time-budget): diloco, streaming fp4-e3m0, streaming topk-2bit (streaming-2), acco
       adaptive, acco 1:1 (acco-2), edit
  pair R=2: ddp and streaming fp4 only, as in r2 (issue 46's goals; with --optimizer muon,
       since r2's acco refuses Muon)
  r4   R=4: ddp for --steps steps, then streaming (at its default outer learning rate) given
       ddp's time
  h    R=2 at equal tokens (ddp's, --equal tokens): ddp, streaming fp4 at H = 20 (P 4), 8
       (P 4) and 4 (P 2, the least H with overlap 1): the loss streaming loses at equal tokens
       by H, the factor that caps how much sooner it can reach ddp's loss. Losses only: at equal
       tokens neither's depends on the link or the time (no link here, and the part may share
       the machine)
  r2-hosts  as r2, ddp and streaming fp4 only, over a real link instead of the emulated one:
       two test hosts (network namespaces, `lowband compare --test-hosts`), each host's egress
       shaped by tc tbf to 100 Mbit/s (no latency added: this kernel has no netem); needs root

The target is ddp's final validation loss. Per run the table gives the time, tokens and outer
bytes to that loss (or "not reached" and the best loss), the validation loss at equal time,
compute utilization measured and planned, tokens/s, and the time `lowband plan` predicted
(lowband.plan.predict_to_target: the run's measured compute a step, the planned CU, the
published loss figures). Then PASS/MISS per goal (issue 30):
  1. streaming fp4 reaches ddp's final loss at least 4x sooner than ddp (r2)
  2. at equal time streaming fp4's validation loss is below ddp's (r2)
  3. every run's time to target, or "not reached" with its best loss (printed)
  4. the planner's predicted time to target within 25% of the measured, for ddp and
     streaming fp4 (r2)
The outer-learning-rate sweep at R=4 is benchmarks/outer_lr.py.

    python benchmarks/time_to_target.py [--part r2|r4|r2-hosts|all] [--steps 200] [--dir DIR]
        [--model mini] [--optimizer adamw|muon]

A part's runs land in DIR/<part>/ (default: a fresh temporary directory); calling again with
the same --dir continues a part that stopped (lowband compare skips finished runs). On 2 cores
r2 at 200 steps takes about 40 minutes, r4 and r2-hosts about 15 each.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "toolkit"))

import lowband  # noqa: E402
from lowband.compare.table import text  # noqa: E402

LINK = ["--link-bandwidth", "100Mbit", "--link-latency", "10ms"]
PARTS = {
    # (algorithm, its own options): runs are named ddp, diloco, streaming, streaming-2, acco,
    # acco-2, edit
    "r2": dict(replicas=2, algos=[
        ("ddp", {}), ("diloco", {}), ("streaming", {}), ("streaming", {"codec": "topk-2bit"}),
        ("acco", {}), ("acco", {"acco_micro": "1:1"}), ("edit", {})]),
    "r4": dict(replicas=4, algos=[("ddp", {}), ("streaming", {})]),
    "pair": dict(replicas=2, algos=[("ddp", {}), ("streaming", {})]),
    "h": dict(replicas=2, equal="tokens", algos=[
        ("ddp", {}), ("streaming", {"sync_every": 20}), ("streaming", {"sync_every": 8}),
        ("streaming", {"sync_every": 4, "fragments": 2})]),
    "r2-hosts": dict(replicas=2, algos=[("ddp", {}), ("streaming", {})], test_hosts=True),
}


def run_part(name: str, steps: int, root: Path, model: str = "mini",
             optimizer: str = "adamw") -> dict:
    part = PARTS[name]
    flags = ["--model", model, "--optimizer", optimizer, "--replicas", str(part["replicas"]),
             "--steps", str(steps),
             "--eval-every", str(max(steps // 10, 1)), "--eval-batches", "8",
             *(LINK if part.get("equal") != "tokens" else [])]
    t0 = time.time()
    result = lowband.compare(algos=part["algos"], flags=flags, directory=root / name,
                             test_hosts=part.get("test_hosts", False),
                             equal=part.get("equal", "time"))
    print(f"\n[{name}] {time.time() - t0:.0f} s; report: {root / name / 'report.html'}", flush=True)
    return result


def goals(result: dict) -> list[tuple[str, bool | None, str]]:
    rows = {r["name"]: r for r in result["runs"]}
    ddp, stream = rows["ddp"], rows["streaming"]
    out = []
    t_ddp, t_s = (r["target"].get("elapsed_s") if r["target"].get("reached") else None
                  for r in (ddp, stream))
    sooner = None if not (t_ddp and t_s) else t_ddp / t_s
    out.append(("streaming fp4 reaches ddp's final loss >= 4x sooner", None if sooner is None
                else sooner >= 4, "not reached" if sooner is None else f"{sooner:.2f}x sooner"))
    a, b = stream["val_loss_at_equal_time"], ddp["val_loss_at_equal_time"]
    out.append(("at equal time streaming fp4's val loss below ddp's",
                None if a is None or b is None else a < b, f"{a} vs {b}"))
    for r in result["runs"]:
        t = r["target"]
        out.append((f"{r['name']}: time to target", None,
                    f"{t['elapsed_s']:.1f} s, {t['tokens']:,} tokens, {t['outer_bytes']:,} B"
                    if t.get("reached") else f"not reached (best {t.get('best_val_loss')})"))
    for r in (ddp, stream):
        measured, planned = r["target"].get("elapsed_s"), r.get("planned_time_to_target_s")
        ok = None if not (measured and planned) else abs(planned / measured - 1) <= 0.25
        out.append((f"{r['name']}: planned time to target within 25% of measured", ok,
                    "-" if ok is None else f"planned {planned:.1f} s, measured {measured:.1f} s "
                    f"({planned / measured - 1:+.1%})"))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["r2", "pair", "r4", "h", "r2-hosts", "all"], default="r2")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--model", default="mini", help="every run's model (micro: the main job's)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"],
                   help="every run's inner optimizer, ddp's too (issue 46)")
    a = p.parse_args()
    root = a.dir or Path(tempfile.mkdtemp(prefix="lowband-time-to-target-"))
    results = {}
    for name in (["r2", "r4", "h", "r2-hosts"] if a.part == "all" else [a.part]):
        results[name] = run_part(name, a.steps, root, a.model, a.optimizer)
        print(text(results[name]), flush=True)
    if "h" in results:
        print("\nloss at equal tokens against ddp's (h):")
        ddp = results["h"]["runs"][0]
        for r in results["h"]["runs"][1:]:
            loss = r["final_val_loss"] / ddp["final_val_loss"] - 1
            print(f"  {r['name']}: {r['final_val_loss']:.4f} ({loss:+.2%}; ddp "
                  f"{ddp['final_val_loss']:.4f})")
    for name in ("r2", "pair", "r2-hosts", "r4"):
        if name in results:
            print(f"\ngoals ({name}):")
            for what, ok, detail in goals(results[name]):
                print(f"  {'PASS' if ok else 'MISS' if ok is False else '    '}  {what}: {detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
