"""Replicas that differ: --straggler (a replica computes FACTOR x slower) and, for diloco and
streaming, --local-steps (adaptive or declared speeds: each replica runs as many inner steps
between two syncs as its speed allows, algorithms/pace.py).

The timeline (timeline.py) replays one replica that stands for all. Replicas that differ are
planned one by one, each as a run of alike replicas at its own pace (its compute a step, its
steps between syncs), and joined at the syncs, which every replica reaches together:

- fixed steps (and every algorithm but diloco and streaming): every replica runs every step,
  and each sync or step waits for the slowest, so a run step lasts the slowest's (compute and
  the stall it does not hide); a faster replica computes for its own share of it;
- adaptive or declared steps: replica r runs n_r inner steps a sync period (pace.Pace's count,
  DEAD_BAND included), and a period lasts the longest of the replicas' own periods.

A replica's compute utilization is its compute over that wall time; the run's is their mean, as
summary.json's compute_utilization is the mean over ranks. docs/plan.md states the model.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from lowband.algorithms import ALGORITHMS as REGISTRY
from lowband.algorithms.pace import Paced, declared, steps_for
from lowband.comm.sends import Run


def steps_per_sync(algorithm: str, run: Run) -> list[int] | None:
    """Each replica's inner steps between two syncs with --local-steps adaptive or declared
    speeds (diloco, streaming), as Pace decides them from its first times: the measured ones
    (each replica's compute a step, its --straggler factor) or the declared speeds; None where
    every replica runs every step (fixed steps, other algorithms)."""
    cls = REGISTRY[algorithm] if algorithm in REGISTRY else None
    if run.local_steps == "fixed" or cls is None or not issubclass(cls, Paced):
        return None
    speeds = declared(run.local_steps, run.replicas)
    times = list(run.slowdowns) if speeds is None else [1 / s for s in speeds]
    return steps_for(times, run.sync_every // run.fragments, run.overlap)  # the run's count


def replica_runs(algorithm: str, run: Run) -> list[tuple[Run, float]] | None:
    """Per replica, a Run of alike replicas at its pace (its step time; with adaptive steps its
    own sync period and steps) and its inner steps per run step; None when every replica runs
    as `run` says (no straggler, every one the same steps): the run is planned as it is."""
    counts = steps_per_sync(algorithm, run)
    period = run.sync_every // run.fragments
    if all(f == 1.0 for f in run.slowdowns) and (counts is None or set(counts) == {period}):
        return None
    alike = {"slowdowns": (1.0,) * run.replicas, "local_steps": "fixed"}
    out = []
    for r, factor in enumerate(run.slowdowns):
        kw = alike | {"step_time": run.step_time * factor}
        rate = 1.0 if counts is None else counts[r] / period
        if counts is not None:
            kw["sync_every"] = counts[r] * run.fragments
            if run.steps is not None:  # its share of the run's syncs
                kw["steps"] = max(1, round(run.steps * rate))
        out.append((replace(run, **kw), rate))
    return out


def join(algorithm: str, run: Run, parts: list[tuple[Run, float]], sims: list):
    """One SimResult of the run from its replicas' (`sims`, in the order of `parts`): a run step
    lasts the longest replica's; cu is the mean of the replicas' compute over it, and
    compute_s and stall_s the mean replica's, so that compute_s + stall_s is the run's wall
    time; the sends per run step those of the replica that sets the pace. `per_replica` says
    how: each replica's factor, steps a sync, utilization, and run_step_s and step_share (its
    mean inner steps a run step), which tokens/s reads (target.timing)."""
    paced = []  # (compute, wall) of each replica per run step
    for (_, rate), sim in zip(parts, sims):
        run_steps = run.steps if run.steps is not None else sim.steps / rate
        paced.append((sim.compute_s / run_steps, (sim.compute_s + sim.stall_s) / run_steps))
    wall = max(w for _, w in paced)
    lead = max(range(len(paced)), key=lambda r: paced[r][1])  # the replica that sets the pace
    ref, rate = sims[lead], parts[lead][1]
    steps = run.steps if run.steps is not None else round(ref.steps / rate)
    compute = statistics.fmean(c for c, _ in paced)
    used = [c / wall for c, _ in paced]
    counts = steps_per_sync(algorithm, run)
    return replace(
        ref, cu=statistics.fmean(used), compute_s=compute * steps,
        stall_s=(wall - compute) * steps, steps=steps, step_time=run.step_time,
        wire_bytes_per_step=round(ref.wire_bytes_per_step * rate, 3),
        transfers_per_step=ref.transfers_per_step * rate,
        sync_period_steps=max(1, round(ref.sync_period_steps / rate)),
        per_replica={"slowdowns": list(run.slowdowns),
                     "local_steps": "fixed" if counts is None else run.local_steps,
                     "steps_per_sync": counts, "utilization": used, "run_step_s": wall,
                     "step_share": statistics.fmean(rate for _, rate in parts)})
