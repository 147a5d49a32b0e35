"""The outer loop's options and its step, shared by every algorithm that keeps outer (last synced)
parameters and steps them with Nesterov SGD (streaming's --outer-rule sparseloco: plain SGD, sgd_step):
diloco, streaming, edit and aedit. The state lives where
--outer-state-device says (the model's device by default; `cpu` keeps it in pinned host memory
when the model is on a GPU); the arithmetic always runs on the model's device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowband.options import ConfigError, Options, option


@dataclass
class OuterOptions(Options):
    title = "outer loop"
    shared_knob = True
    sync_every: int = option(20, "H: inner steps between two syncs of the same fragment or block")
    outer_lr: float = option(0.7, "outer SGD learning rate")
    outer_momentum: float = option(0.9, "outer SGD Nesterov momentum")
    outer_state_device: str = option("same", "where the outer parameters and momentum live: same "
                                     "(the model's device) or cpu (pinned host memory: frees GPU "
                                     "memory, costs a PCIe round trip a sync)", ("same", "cpu"))
    eval_params: str = option("local", "evaluate the local (replica) or the outer parameters",
                              ("local", "outer"))

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.sync_every <= 0:
            raise ConfigError(f"--sync-every must be a positive integer, got {cfg.sync_every}.")
        if not cfg.outer_lr > 0:
            raise ConfigError(f"--outer-lr must be positive, got {cfg.outer_lr}.")
        if not 0 <= cfg.outer_momentum < 1:
            raise ConfigError(f"--outer-momentum must lie in [0, 1), got {cfg.outer_momentum}.")


def outer_home(config, device: torch.device) -> torch.device:
    """Where a run keeps its outer parameters and momentum (--outer-state-device)."""
    return torch.device("cpu") if config.outer_state_device == "cpu" else device


def kept_at(t: torch.Tensor, home: torch.device) -> torch.Tensor:
    """A copy of t that lives at `home`; in page-locked host memory when t is on a GPU and home
    is the CPU, so the copies each way run asynchronously on the compute stream."""
    kept = t.detach().to(home, copy=True)
    return kept.pin_memory() if t.is_cuda and home.type == "cpu" else kept


@torch.no_grad()
def nesterov_step(outer: torch.Tensor, momentum: torch.Tensor, delta: torch.Tensor,
                  lr: float, mu: float) -> torch.Tensor:
    """One outer Nesterov SGD step, m <- mu m + delta; outer <- outer - lr (delta + mu m), worked
    out on delta's device wherever the state lives (a round trip over PCIe costs far less than
    the arithmetic on the host), the state written back without waiting. Returns the new outer
    parameters on delta's device. Host readers of a CPU state call `settle` first."""
    o = outer.to(delta.device, non_blocking=True)
    m = momentum.to(delta.device, non_blocking=True)
    m.mul_(mu).add_(delta)
    o.sub_(lr * (delta + mu * m))
    if o.data_ptr() != outer.data_ptr():
        outer.copy_(o, non_blocking=True)
        momentum.copy_(m, non_blocking=True)
    return o


@torch.no_grad()
def sgd_step(outer: torch.Tensor, delta: torch.Tensor, lr: float) -> torch.Tensor:
    """SparseLoCo's outer step (streaming's --outer-rule sparseloco): outer <- outer - lr delta,
    no momentum (each replica's error feedback, decayed, stands in for it); worked out and
    written back as nesterov_step does. Returns the new outer parameters on delta's device."""
    o = outer.to(delta.device, non_blocking=True)
    o.sub_(lr * delta)
    if o.data_ptr() != outer.data_ptr():
        outer.copy_(o, non_blocking=True)
    return o


def settle(device: torch.device) -> None:
    """Wait for the state's asynchronous copies to the host (before the host reads it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
