"""The inner learning-rate schedule, read by the trainer and by algorithms that keep their own
step count (aedit, acco).

Without --time-budget: linear warm-up, then cosine decay over --steps; a function of the step
alone, so a run is as reproducible as before. With --time-budget (warm-up, stable, decay): the
linear warm-up over --warmup-steps, the peak held, then a cosine decay to the floor over the last
DECAY of the run, where the run's progress is the larger of the budget's elapsed fraction and
step / --steps (--steps stays an upper bound, so the decay lands at whichever end comes first).
"""

from __future__ import annotations

import math

DECAY = 0.2  # with --time-budget: the last part of the run over which the learning rate decays


def lr_at(cfg, step: float, elapsed: float | None = None) -> float:
    """The learning rate at schedule step `step` (0-based; acco and aedit pass their budgets'
    progress) and, with --time-budget, `elapsed`: the fraction of the budget spent, as every
    rank agreed it (clock.RunClock; aedit: its replica's own)."""
    floor = cfg.lr * cfg.min_lr_ratio
    if getattr(cfg, "time_budget", None):
        warm = min((step + 1) / cfg.warmup_steps, 1.0) if cfg.warmup_steps else 1.0
        progress = max(elapsed or 0.0, step / cfg.steps)
        into = min(max(progress - (1 - DECAY), 0.0) / DECAY, 1.0)
        return warm * (floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * into)))
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
