"""Fault injectors that work with every algorithm, for experiments, tests and benchmarks.

--straggler REPLICA:FACTOR   the ranks of REPLICA compute FACTOR x slower: after each step they
                             sleep (FACTOR - 1) x the step's compute time (counted as compute)
--corrupt REPLICA:STEP[:SCALE]  after inner step STEP, Gaussian noise of SCALE (default 1) x each
                             tensor's RMS is added to REPLICA's parameters: a bad update that
                             gradient clipping cannot undo, so the loss spikes
--crash-checkpoint STEP      every rank dies between writing the checkpoint of STEP and making
                             it current (checkpoint.py), as a crash mid-write would
--kill REPLICA:STEP          after inner step STEP every rank of REPLICA kills itself (SIGKILL),
                             as a lost node or site would; with --elastic only in the group's
                             first life, so a restarted group trains on
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from lowband.options import ConfigError, Options, option


def _parse(text: str, flag: str, form: str, kinds: tuple, required: int) -> tuple:
    parts = text.split(":")
    try:
        if not required <= len(parts) <= len(kinds):
            raise ValueError
        return tuple(kind(p) for kind, p in zip(kinds, parts))
    except ValueError:
        raise ConfigError(f"cannot read {flag} '{text}': write it as {form}.") from None


def parse_straggler(text: str, replicas: int) -> tuple[int, float] | None:
    if not text:
        return None
    replica, factor = _parse(text, "--straggler", "REPLICA:FACTOR, e.g. 1:4", (int, float), 2)
    if not 0 <= replica < replicas or not factor >= 1:
        raise ConfigError(f"--straggler {text}: the replica must be in 0..{replicas - 1} and the "
                          "factor at least 1.")
    return replica, factor


def parse_corrupt(text: str, replicas: int, steps: int) -> tuple[int, int, float] | None:
    if not text:
        return None
    values = _parse(text, "--corrupt", "REPLICA:STEP[:SCALE], e.g. 1:50:2", (int, int, float), 2)
    replica, step, scale = (*values, 1.0)[:3]
    if not 0 <= replica < replicas or not 1 <= step <= steps or not scale > 0:
        raise ConfigError(f"--corrupt {text}: the replica must be in 0..{replicas - 1}, the step "
                          f"in 1..{steps} and the scale positive.")
    return replica, step, scale


def parse_kill(text: str, replicas: int, steps: int) -> tuple[int, int] | None:
    if not text:
        return None
    replica, step = _parse(text, "--kill", "REPLICA:STEP, e.g. 1:20", (int, int), 2)
    if not 0 <= replica < replicas or not 1 <= step <= steps:
        raise ConfigError(f"--kill {text}: the replica must be in 0..{replicas - 1} and the step "
                          f"in 1..{steps}.")
    return replica, step


@dataclass
class FaultOptions(Options):
    title = "fault injection (every algorithm)"
    straggler: str = option("", "REPLICA:FACTOR: that replica computes FACTOR x slower")
    corrupt: str = option("", "REPLICA:STEP[:SCALE]: noise of SCALE x RMS added to that replica's "
                          "parameters after STEP")
    crash_checkpoint: int = option(0, "die between writing and renaming the checkpoint of this "
                                   "step (to test that the previous one survives)")
    kill: str = option("", "REPLICA:STEP: every rank of that replica is killed (SIGKILL) after "
                       "STEP, as a lost site would be (with --elastic, in its first life only)")

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.crash_checkpoint < 0:
            raise ConfigError(f"--crash-checkpoint must be zero or positive, got {cfg.crash_checkpoint}.")
        parse_straggler(cfg.straggler, cfg.replicas)
        parse_corrupt(cfg.corrupt, cfg.replicas, cfg.steps)
        parse_kill(cfg.kill, cfg.replicas, cfg.steps)


LIFE_ENV = "LOWBAND_LIFE"  # how many times the launcher restarted this elastic group


class Faults:
    def __init__(self, cfg, replica: int, seed: int):
        self.straggler = parse_straggler(cfg.straggler, cfg.replicas)
        self.corrupt = parse_corrupt(cfg.corrupt, cfg.replicas, cfg.steps)
        self.crash_checkpoint = cfg.crash_checkpoint
        self.kill = parse_kill(cfg.kill, cfg.replicas, cfg.steps)
        if os.environ.get(LIFE_ENV, "0") != "0":  # a restarted elastic group is not killed again
            self.kill = None
        self.replica, self.seed = replica, seed

    def maybe_die(self, step: int) -> None:
        """SIGKILL this process after `step` if its replica is the one --kill names."""
        if self.kill and self.kill == (self.replica, step):
            os.kill(os.getpid(), signal.SIGKILL)

    def slow_down(self, compute_s: float) -> None:
        """Make this rank's step slower if its replica is the straggler."""
        if self.straggler and self.straggler[0] == self.replica:
            time.sleep((self.straggler[1] - 1) * compute_s)

    @torch.no_grad()
    def after_step(self, step: int, model: torch.nn.Module) -> bool:
        """Corrupt this replica's parameters after inner step `step` (1-based) if asked."""
        if not self.corrupt or self.corrupt[:2] != (self.replica, step):
            return False
        g = torch.Generator().manual_seed(self.seed + step)
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g).to(p.device, p.dtype)
            if isinstance(p, DTensor):  # sharded (edit, aedit): this rank's piece of the same noise
                noise = distribute_tensor(noise, p.device_mesh, p.placements, src_data_rank=None)
            p.add_(noise * self.corrupt[2] * p.float().pow(2).mean().sqrt().to(p.dtype))
        return True
