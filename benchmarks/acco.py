"""ddp vs zero1 vs acco over an emulated link on which one round lasts about one step's compute.

Four ranks (R=4 replicas, S=1) train the same model with each algorithm through lowband's own
trainer (`lowband.train.train`, called once per configuration inside the same four worker
processes, so process start-up is paid once). First two short ddp runs (without a link, then
on the link the first one suggests, so that compute is measured as the runs below see it)
measure one step's compute time C (the median over ranks and steps of compute_s) and the bytes
a rank sends per step; the emulated outer link is then sized so that those bytes take C:
    bandwidth = 8 x (wire bytes per rank per step) / C
A zero1 or acco round moves about the same bytes as ddp's all-reduce (reduce-scatter + all-
gather), so it too lasts about C. Then, on that link, all with the same --steps and
--grad-accum A, so the same tokens (acco's budget is ddp's micro-batches: algorithms/acco.py),
and the same clipping (--clip):
  acco    adaptive micro-batch counts. Each acco step has two rounds, so with a round as long
          as A micro-batches' compute it takes about m = 2A micro-batches a rank and makes
          about half ddp's updates, of a batch about twice ddp's
  ddp     --grad-accum A
  zero1   the same (and the same batches as ddp)
  ddp-same-batch  ddp with acco's batch per update (--grad-accum = round(m)) and about the
          same tokens (information: what the larger batch alone costs at equal tokens)
  acco-ddp-batch  acco with ddp's batch per update: fixed counts A/2 : A - A/2, so the same
          batches per update and the same number of updates as ddp (the rounds then
          do not hide behind compute on this link: its loss, not its speed, is the point)
and the same three again with replica 1 four times slower (--straggler 1:4), for fewer steps
(throughput only). Prints per run: steps taken, micro-batches per step, tokens, tokens/s,
compute utilization, compute seconds per micro-batch (ms/micro: what CPU sharing did to the
compute itself) and final validation loss. Then PASS/MISS per goal:
  1.  acco's compute utilization >= 90% on a link where ddp's is at most ~55%
  2.  acco's final validation loss within 2% of ddp's at equal tokens and ddp's batch per
      update (acco-ddp-batch); adaptive acco's and ddp-same-batch's are printed beside it
  3.  with the straggler, acco's tokens/s >= 1.5 x ddp's

    python benchmarks/acco.py [--model nano] [--steps 160] [--grad-accum 2] [--batch-size 8]
        [--seq-len 128] [--straggler-steps 40] [--skip-straggler] [--clip both|none]
        [--keep DIR] [--json FILE]

On a 2-core machine the four ranks share two cores (one thread each); the defaults take a few
minutes there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4


def _config(a, run_dir: Path, **over):
    from lowband.config import Config

    # --clip both: ddp's and zero1's steps clip at --grad-clip (lowband's default) and so do
    # acco's rounds (--acco-clip); none: nobody clips (the authors' code: neither their ddp nor
    # their acco does)
    clip = {"grad_clip": 1.0 if a.clip == "both" else 0.0}
    if over.get("algo") == "acco":
        clip["acco_clip"] = a.clip == "both"
    fields = dict(replicas=WORLD, shards=1, model=a.model, batch_size=a.batch_size, **clip,
                  seq_len=a.seq_len, grad_accum=a.grad_accum, seed=a.seed, progress=False,
                  eval_batches=a.eval_batches, run_dir=str(run_dir), link_latency="0ms")
    fields.update(over)
    return Config(**fields)


def worker(rank: int, a, port: int, root: str, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from lowband.telemetry import read_events
    from lowband.train import train

    root = Path(root)
    # calibration: a short ddp run without a link gives a first link; a second one on that link
    # measures the step's compute as the runs below see it (compute not overlapped by transfers)
    plan = None
    for attempt, bandwidth in enumerate(("", None)):
        link = bandwidth if bandwidth is not None else f"{plan['bandwidth_bps'] / 1e6:.3f}Mbit"
        calib = _config(a, root / f"calibrate{attempt}", algo="ddp", steps=a.calibrate_steps,
                        eval_every=0, link_bandwidth=link)
        summary = train(calib)
        box = [None]
        if rank == 0:
            steps = [e for e in read_events(calib.run_dir, ("step",)) if e["step"] > 4]
            compute = statistics.median(e["compute_s"] for e in steps)
            wire = summary["outer_wire_bytes"] / WORLD / calib.steps  # bytes per rank per step
            box = [{"compute_s": compute, "wire_bytes": wire, "bandwidth_bps": 8 * wire / compute}]
        dist.broadcast_object_list(box, src=0)
        plan = box[0]
    link = f"{plan['bandwidth_bps'] / 1e6:.3f}Mbit"

    results = []

    def run(name: str, **over) -> dict | None:
        cfg = _config(a, root / name, link_bandwidth=link,
                      warmup_steps=max(over["steps"] // 16, 1), **over)
        t0 = time.time()
        s = train(cfg)
        if rank != 0:
            return None
        results.append({"name": name, **_measure(cfg, s), "elapsed_s": time.time() - t0})
        print(f"  {name:16s} done in {time.time() - t0:5.1f} s", file=sys.stderr, flush=True)
        return results[-1]

    # acco first: its batch per update (m, about 2A when a round lasts A micro-batches' compute)
    # sets ddp-same-batch's --grad-accum
    acco = run("acco", algo="acco", steps=a.steps, eval_every=max(a.steps // 16, 1))
    match = [None]
    if rank == 0:
        accum = max(round(acco["micro_per_step"]), 1)
        match = [(accum, max(round(a.steps * a.grad_accum / accum), 1))]
    dist.broadcast_object_list(match, src=0)
    accum, same_steps = match[0]
    run("ddp", algo="ddp", steps=a.steps, eval_every=max(a.steps // 8, 1))
    run("zero1", algo="zero1", steps=a.steps, eval_every=max(a.steps // 8, 1))
    run("ddp-same-batch", algo="ddp", grad_accum=accum, steps=same_steps,
        eval_every=max(same_steps // 8, 1))
    # acco with ddp's batch per update: fixed counts, N1 + N2 = A, so the same updates too
    half = a.grad_accum // 2
    run("acco-ddp-batch", algo="acco", steps=a.steps, eval_every=max(a.steps // 8, 1),
        acco_micro=f"{half}:{a.grad_accum - half}")
    if not a.skip_straggler:
        for name in ("ddp", "zero1", "acco"):
            run(f"{name}+straggler", algo=name, steps=a.straggler_steps, eval_every=0,
                straggler=f"1:{a.straggler_factor:g}")
    if rank == 0:
        queue.put({"plan": {**plan, "link": link}, "runs": results})
    dist.destroy_process_group()


def _measure(cfg, summary: dict) -> dict:
    """The summary's figures and the curve of validation loss against global tokens."""
    from lowband.telemetry import read_events

    events = read_events(cfg.run_dir, ("step", "eval"))
    tokens_at: dict[int, int] = {}
    for e in events:
        if e["kind"] == "step":
            tokens_at[e["step"]] = tokens_at.get(e["step"], 0) + e["tokens"]
    curve: dict[int, list[float]] = {}
    for e in events:
        if e["kind"] == "eval":
            curve.setdefault(e["step"], []).append(e["val_loss"])
    points = sorted((tokens_at[s], statistics.fmean(v)) for s, v in curve.items() if s in tokens_at)
    per_micro = cfg.batch_size * cfg.seq_len
    late = [e for e in read_events(cfg.run_dir, ("step",)) if e["step"] > 2]
    by_rank: dict[int, list] = {}
    for e in late:
        by_rank.setdefault(e["rank"], []).append(e)
    micro_late = statistics.fmean((max(x["tokens"] for x in es) - min(x["tokens"] for x in es))
                                  / per_micro / max(len(es) - 1, 1) for es in by_rank.values())
    compute_per_step = statistics.median(e["compute_s"] for e in late) if late else 0.0
    comm = read_events(cfg.run_dir, ("comm",))
    rounds = {}  # (rank, tag) -> durations; a round spans its grad's start to its params' end
    for e in comm:
        rounds.setdefault((e["rank"], e["tag"]), []).append(e)
    spans = [b["end"] - g["start"] for r in range(WORLD) for pre in ("", "est-")
             for g, b in zip(rounds.get((r, pre + "grad"), []), rounds.get((r, pre + "params"), []))]
    return {"steps": summary["steps_run"], "tokens": summary["tokens"],
            "tokens_per_s": summary["tokens_per_s"],
            "micro_per_step_late": micro_late, "compute_per_step_s": compute_per_step,
            "round_s": statistics.median(spans) if spans else None,
            "compute_utilization": summary["compute_utilization"], "wall_s": summary["wall_s"],
            "ms_per_micro": summary["compute_s"] / (summary["tokens"] / WORLD / per_micro),
            "final_val_loss": summary["final_val_loss"], "curve": points,
            "micro_per_step": summary["tokens"] / summary["steps_run"] / WORLD / per_micro}


def loss_at(curve: list[tuple[float, float]], tokens: float) -> float:
    """Linear interpolation of a (tokens, loss) curve; the ends are held."""
    if tokens <= curve[0][0]:
        return curve[0][1]
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if t0 <= tokens <= t1:
            return l0 + (l1 - l0) * (tokens - t0) / (t1 - t0)
    return curve[-1][1]


def report(out: dict, a) -> list[bool]:
    plan, runs = out["plan"], {r["name"]: r for r in out["runs"]}
    print(f"\nmodel {a.model}, {WORLD} ranks (gloo, one thread each), micro-batch "
          f"{a.batch_size}x{a.seq_len}, ddp/zero1 --grad-accum {a.grad_accum}")
    print(f"calibration (ddp): compute {plan['compute_s'] * 1000:.0f} ms/step, "
          f"{plan['wire_bytes'] / 1e6:.2f} MB/rank/step -> link {plan['link']} (one round ~ one "
          "step's compute)")
    print(f"\n{'run':18s}{'steps':>6s}{'micro/step':>11s}{'tokens':>10s}{'tokens/s':>10s}"
          f"{'compute util':>13s}{'ms/micro':>9s}{'val loss':>10s}")
    for r in out["runs"]:
        print(f"{r['name']:18s}{r['steps']:6d}{r['micro_per_step']:11.1f}{r['tokens']:10d}"
              f"{r['tokens_per_s']:10.0f}{100 * r['compute_utilization']:12.1f}%"
              f"{1000 * r['ms_per_micro']:9.1f}{r['final_val_loss']:10.4f}")
    ok = []
    ddp, acco = runs["ddp"], runs["acco"]
    print(f"\nmeasured on the link: ddp's compute {1000 * ddp['compute_per_step_s']:.0f} ms/step "
          f"({a.grad_accum} micro-batches), one acco round {1000 * acco['round_s']:.0f} ms "
          f"(reduce-scatter to all-gather), one zero1 round "
          f"{1000 * runs['zero1']['round_s']:.0f} ms: round / step compute = "
          f"{acco['round_s'] / ddp['compute_per_step_s']:.2f}")
    u_a, u_d = acco["compute_utilization"], ddp["compute_utilization"]
    ok.append(u_a >= 0.90)
    print(f"\n1. compute utilization: acco {100 * u_a:.1f}% (goal >= 90%), ddp {100 * u_d:.1f}% "
          f"(setting: at most ~55%{'' if u_d <= 0.575 else ', NOT MET: the link is too fast'}) "
          f"-> {'PASS' if ok[-1] else 'MISS'}")
    fixed, l_d = runs["acco-ddp-batch"], ddp["final_val_loss"]
    rel = (fixed["final_val_loss"] - l_d) / l_d
    ok.append(abs(rel) <= 0.02 and fixed["tokens"] == ddp["tokens"] == acco["tokens"])
    print(f"2. final validation loss at equal tokens ({ddp['tokens']}) and ddp's batch per update "
          f"(acco --acco-micro {fixed['micro_per_step']:.0f} a step, fixed; {fixed['steps']} "
          f"updates, ddp {ddp['steps']}), clipping: {a.clip}: ddp {l_d:.4f}, zero1 "
          f"{runs['zero1']['final_val_loss']:.4f}, acco {fixed['final_val_loss']:.4f} "
          f"({100 * rel:+.2f}%, goal within 2%) -> {'PASS' if ok[-1] else 'MISS'}")
    l_a = acco["final_val_loss"]
    print(f"   adaptive acco on this link (its batch per update {acco['micro_per_step']:.1f} "
          f"micro-batches, {acco['steps']} updates): {l_a:.4f} ({100 * (l_a - l_d) / l_d:+.2f}% "
          "vs ddp)")
    same = runs["ddp-same-batch"]
    t_eq = min(same["tokens"], acco["tokens"])
    l_s, l_a = loss_at(same["curve"], t_eq), loss_at(acco["curve"], t_eq)
    print(f"   information: against ddp with acco's batch per update (--grad-accum "
          f"{round(same['micro_per_step'])}, {same['steps']} updates, {same['tokens']} tokens), at "
          f"{t_eq} tokens: ddp {l_s:.4f}, acco {l_a:.4f} ({100 * (l_a - l_s) / l_s:+.2f}%)")
    if "acco+straggler" in runs:
        sd, sa = runs["ddp+straggler"]["tokens_per_s"], runs["acco+straggler"]["tokens_per_s"]
        sz = runs["zero1+straggler"]["tokens_per_s"]
        ok.append(sa >= 1.5 * sd)
        print(f"3. with replica 1 {a.straggler_factor:g}x slower: tokens/s acco {sa:.0f}, ddp "
              f"{sd:.0f}, zero1 {sz:.0f}: acco/ddp = {sa / sd:.2f} (goal >= 1.5) -> "
              f"{'PASS' if ok[-1] else 'MISS'}")
    print(f"\nacco/ddp tokens/s without straggler: {acco['tokens_per_s'] / ddp['tokens_per_s']:.2f}")
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="nano")
    p.add_argument("--steps", type=int, default=160,
                   help="ddp's steps (acco: the same micro-batches, about half the steps)")
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--calibrate-steps", type=int, default=16)
    p.add_argument("--straggler-steps", type=int, default=40)
    p.add_argument("--straggler-factor", type=float, default=4.0)
    p.add_argument("--skip-straggler", action="store_true")
    p.add_argument("--clip", choices=("both", "none"), default="both",
                   help="both: ddp, zero1 and acco's rounds clip at 1.0 (acco with --acco-clip); "
                   "none: nobody clips, as in the authors' code")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", help="keep the run directories here (default: a temporary directory)")
    p.add_argument("--json", help="write the figures to this file")
    a = p.parse_args(argv)
    if a.grad_accum < 2:
        p.error("--grad-accum must be at least 2: acco-ddp-batch splits it into two groups")
    from lowband.data import load_tokens
    from lowband.launch.local import free_port

    load_tokens("builtin")  # build the corpus cache once
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        root = a.keep or tmp
        Path(root).mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        mp.start_processes(worker, args=(a, free_port(), root, queue), nprocs=WORLD,
                           start_method="spawn")
        out = queue.get(timeout=60)
    ok = report(out, a)
    print(f"\ntotal {time.time() - t0:.0f} s; torch {torch.__version__}, {os.cpu_count()} cores")
    if a.json:
        Path(a.json).write_text(json.dumps({**out, "goals_met": ok}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
