"""Time to a target: how long each algorithm takes to train the run's tokens on its link, and
how soon it reaches the loss ddp ends at (plan/loss.py's figures); which H and codec to take.

A run of s steps of T seconds of compute at compute utilization CU takes s·T/CU seconds (the
simulation's compute plus stall) and trains s times the tokens of a step (R·S ranks ×
--batch-size × --grad-accum × --seq-len). ddp reaches its own final loss at the end of its run;
an algorithm whose loss at equal tokens is (1 + p) times ddp's needs `tokens_factor` times
ddp's tokens for it, at its own tokens per second. With replicas that differ (--straggler,
--local-steps) the tokens it needs stay the figures' (tokens merged from unequal replicas are
taken to count as equal ones: an assumption) and only its tokens per second change.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict

from lowband.algorithms import ALGORITHMS as REGISTRY
from lowband.algorithms.pace import PaceOptions
from lowband.options import ConfigError
from lowband.plan.loss import penalty

# the codecs from the most precise to the least: the recommendation takes the first that fits
BY_PRECISION = ("fp32", "bf16", "int8", "fp4-e2m1", "fp4-e3m0", "topk-fp4", "topk-2bit")
H_CANDIDATES = (25, 30, 50, 100, 200, 300, 500)  # the range of the figures for H (plan/loss.py)


def timing(cfg, run, row: dict) -> dict:
    """A row's tokens and times: tokens_per_step, tokens_per_s, and for a whole run its steps'
    wall_s and tokens (with --time-budget: the steps, tokens and seconds that fit in it); the
    loss penalty at equal tokens where a figure applies. None where the row has no link (CU not
    simulated). Replicas that differ (the row's per_replica): a run step lasts its run_step_s
    and trains step_share of every rank's tokens (adaptive steps: fewer on a slow replica)."""
    per_step = cfg.world * cfg.batch_size * cfg.grad_accum * cfg.seq_len
    replicas = row.get("per_replica")
    if replicas:  # replicas of unequal steps a sync train fewer tokens a run step
        per_step *= replicas["step_share"]
    fit = penalty(REGISTRY[cfg.algo].loss_fit, run.params, run.replicas, run.sync_every,
                  cfg.algo, getattr(cfg, "optimizer", "adamw"))
    out = {"tokens_per_step": per_step, "tokens_per_s": None, "wall_s": None, "tokens": None,
           "loss_penalty": None if fit is None else asdict(fit)}
    if row.get("cu") is None:
        return out
    step_s = replicas["run_step_s"] if replicas else run.step_time / row["cu"]
    out["tokens_per_s"] = per_step / step_s
    if run.steps is not None:
        steps, wall = run.steps, row["compute_s"] + row["stall_s"]
        budget = getattr(cfg, "time_budget", None)
        if budget and wall > budget:  # the run ends on time, after the steps that fit
            steps, wall = max(1, math.floor(budget / step_s)), budget
        out |= {"wall_s": wall, "tokens": steps * per_step, "steps": steps}
    return out


def to_ddp_loss(row: dict, ddp: dict) -> dict:
    """How soon a row reaches the loss ddp's run ends at: time_to_ddp_loss_s (seconds, for a
    whole run) and vs_ddp (that over ddp's own time); None without a figure or a link."""
    fit, speed = row.get("loss_penalty"), row.get("tokens_per_s")
    if fit is None or not speed or not ddp.get("tokens_per_s"):
        return {"time_to_ddp_loss_s": None, "vs_ddp": None}
    ratio = fit["tokens_factor"] * ddp["tokens_per_s"] / speed
    seconds = None if ddp.get("wall_s") is None else ratio * ddp["wall_s"]
    return {"time_to_ddp_loss_s": seconds, "vs_ddp": ratio}


def recommend(cfg, make_run, simulate, target: float) -> dict | None:
    """For an algorithm of the DiLoCo family on a link: the smallest H (of H_CANDIDATES, made a
    multiple of P above tau·P) and with it the most precise codec (BY_PRECISION) whose CU reaches
    `target`: the least loss penalty (it rises with H; codecs have no figure, so precision
    ranks them). make_run(cfg) -> Run, simulate(run) -> CU. None when the algorithm is not of
    that family or has no link; {"sync_every": None} when nothing reaches the target."""
    if REGISTRY[cfg.algo].loss_fit != "diloco" or not cfg.link_bandwidth:
        return None
    P, tau = cfg.fragments, cfg.overlap
    for h in sorted({math.ceil(max(h, (tau + 1) * P) / P) * P for h in H_CANDIDATES}):
        for codec in BY_PRECISION:
            trial = copy.copy(cfg)
            trial.sync_every, trial.codec = h, codec
            try:  # --local-steps other than fixed: H/P must divide the run's steps, evaluations
                PaceOptions.check(trial)  # and checkpoints, or lowband train refuses the H
            except ConfigError:
                break
            run = make_run(trial)
            cu = simulate(run)
            if cu >= target:
                fit = penalty("diloco", run.params, run.replicas, h, cfg.algo,
                              getattr(cfg, "optimizer", "adamw"))
                return {"sync_every": h, "codec": codec, "cu": cu, "loss_penalty": fit.loss,
                        "fit": fit.fit, "outside": fit.outside}
    return {"sync_every": None, "tried": f"H {min(H_CANDIDATES)}-{max(H_CANDIDATES)}, "
            f"codecs {', '.join(BY_PRECISION)}"}
