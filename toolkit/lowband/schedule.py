"""The inner learning-rate schedule, read by the trainer and by algorithms that keep their own
step count (aedit)."""

from __future__ import annotations

import math


def lr_at(cfg, step: int) -> float:
    """Linear warm-up to cfg.lr, then cosine decay to cfg.lr * cfg.min_lr_ratio at the end."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
