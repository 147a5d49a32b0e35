"""The outer loop's options, read by every algorithm that keeps outer (last synced) parameters
and steps them with Nesterov SGD: diloco, streaming, edit and aedit."""

from __future__ import annotations

from dataclasses import dataclass

from lowband.options import ConfigError, Options, option


@dataclass
class OuterOptions(Options):
    title = "outer loop"
    shared_knob = True
    sync_every: int = option(20, "H: inner steps between two syncs of the same fragment or block")
    outer_lr: float = option(0.7, "outer SGD learning rate")
    outer_momentum: float = option(0.9, "outer SGD Nesterov momentum")
    outer_state_device: str = option("cpu", "where the outer parameters and momentum live: cpu or "
                                     "same (the model's device)", ("cpu", "same"))
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
