"""The compute of one step, measured here: `lowband plan --step-time probe`, and `lowband plan`
alone (the main job's step, on this machine).

A short probe in this process on the config's device: the config's model (built as `lowband
train` builds it, from --seed), --grad-accum micro-batches of --batch-size x --seq-len random
token ids, forward and backward, the gradient clip and a step of the run's inner optimizer
(--optimizer: AdamW, or Muon with AdamW, algorithms/inner.py): what ddp's step computes
on one rank, without its communication or an algorithm's own work. Two warm-up steps, then the
median of the timed ones.
"""

from __future__ import annotations

import statistics
import time

import torch

from lowband import models
from lowband.algorithms.inner import make_optimizer_factory
from lowband.models import lm_loss


def device_of(cfg) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


WARMUP, TIMED = 2, 5  # the probe's steps: untimed first, then those whose median it takes


def step_time(cfg, steps: int = TIMED, warmup: int = WARMUP) -> float:
    """Median seconds of compute of one inner step of cfg's model on this machine."""
    device = device_of(cfg)
    vocab = cfg.vocab_size or models.spec(cfg.model).vocab_size  # the model's whole vocabulary
    model = models.for_training(models.build(cfg, vocab)).to(device).train()
    optimizer = make_optimizer_factory(cfg, device, models.blocks_of(model))(model.parameters())
    generator = torch.Generator().manual_seed(cfg.seed)
    times = []
    for i in range(warmup + steps):
        batches = [torch.randint(0, vocab, (cfg.batch_size, cfg.seq_len + 1), generator=generator)
                   .to(device) for _ in range(cfg.grad_accum)]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for b in batches:
            (lm_loss(model, b[:, :-1], b[:, 1:], cfg.precision) / cfg.grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)
