"""Fault injectors that work with every algorithm, for experiments, tests and benchmarks.

--straggler REPLICA:FACTOR[,REPLICA:FACTOR...]  the ranks of each REPLICA compute FACTOR x
                             slower: after each step they sleep (FACTOR - 1) x the step's
                             compute time (counted as compute); 0:1,1:2,2:4 sites of 3 speeds
--corrupt REPLICA:STEP[:SCALE]  after inner step STEP, Gaussian noise of SCALE (default 1) x each
                             tensor's RMS is added to REPLICA's parameters: a bad update that
                             gradient clipping cannot undo, so the loss spikes
--crash-checkpoint STEP      every rank dies between writing the checkpoint of STEP and making
                             it current (checkpoint.py), as a crash mid-write would
--kill REPLICA:STEP[,...]    after inner step STEP every rank of REPLICA kills itself (SIGKILL),
                             as a lost node or site would; each kill happens once (a marker in
                             RUN/logs/), so a restarted group or a resumed run trains past it.
                             `lighthouse:STEP` (--elastic): the first rank past STEP asks the
                             launcher to stop the torchft Lighthouse (RUN/logs/kill-lighthouse),
                             as if its host were lost
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lowband.options import ConfigError, Options, option


def _parse(text: str, flag: str, form: str, kinds: tuple, required: int) -> tuple:
    parts = text.split(":")
    try:
        if not required <= len(parts) <= len(kinds):
            raise ValueError
        return tuple(kind(p) for kind, p in zip(kinds, parts))
    except ValueError:
        raise ConfigError(f"cannot read {flag} '{text}': write it as {form}.") from None


def parse_straggler(text: str, replicas: int) -> dict[int, float]:
    """--straggler REPLICA:FACTOR[,REPLICA:FACTOR...]: each named replica's factor."""
    out = {}
    for part in filter(None, text.split(",")):
        replica, factor = _parse(part, "--straggler", "REPLICA:FACTOR[,REPLICA:FACTOR...], "
                                 "e.g. 1:4 or 0:1,1:2,2:4", (int, float), 2)
        if not 0 <= replica < replicas or not factor >= 1:
            raise ConfigError(f"--straggler {text}: each replica must be in 0..{replicas - 1} "
                              "and each factor at least 1.")
        if replica in out:
            raise ConfigError(f"--straggler {text} names replica {replica} twice: give each "
                              "replica one factor.")
        out[replica] = factor
    return out


def parse_corrupt(text: str, replicas: int, steps: int) -> tuple[int, int, float] | None:
    if not text:
        return None
    values = _parse(text, "--corrupt", "REPLICA:STEP[:SCALE], e.g. 1:50:2", (int, int, float), 2)
    replica, step, scale = (*values, 1.0)[:3]
    if not 0 <= replica < replicas or not 1 <= step <= steps or not scale > 0:
        raise ConfigError(f"--corrupt {text}: the replica must be in 0..{replicas - 1}, the step "
                          f"in 1..{steps} and the scale positive.")
    return replica, step, scale


LIGHTHOUSE = "lighthouse"


def parse_kill(text: str, replicas: int, steps: int, elastic: bool = False) -> list[tuple]:
    """--kill REPLICA:STEP[,REPLICA:STEP...]: (replica, step) pairs; the replica may be
    'lighthouse' with --elastic."""
    out = []
    for part in filter(None, text.split(",")):
        who, step = _parse(part, "--kill", "REPLICA:STEP[,REPLICA:STEP...], e.g. 1:20",
                           (str, int), 2)
        if who == LIGHTHOUSE and not elastic:
            raise ConfigError(f"--kill {part}: only an --elastic run has a Lighthouse to kill.")
        replica = who if who == LIGHTHOUSE else _parse(who, "--kill", "REPLICA:STEP, e.g. 1:20 "
                                                       "or lighthouse:20", (int,), 1)[0]
        if replica != LIGHTHOUSE and not 0 <= replica < replicas or not 1 <= step <= steps:
            raise ConfigError(f"--kill {part}: the replica must be in 0..{replicas - 1} (or "
                              f"'lighthouse') and the step in 1..{steps}.")
        out.append((replica, step))
    return out


def lighthouse_kill_asked(run_root) -> bool:
    """For the launcher that serves the Lighthouse: whether a rank asked for it to be killed
    (--kill lighthouse:STEP); the request is taken (removed)."""
    request = Path(run_root) / "logs" / "kill-lighthouse"
    try:
        request.unlink()
        return True
    except FileNotFoundError:
        return False


@dataclass
class FaultOptions(Options):
    title = "fault injection (every algorithm)"
    straggler: str = option("", "REPLICA:FACTOR[,REPLICA:FACTOR...]: each replica named "
                            "computes FACTOR x slower (0:1,1:2,2:4: three speeds)")
    corrupt: str = option("", "REPLICA:STEP[:SCALE]: noise of SCALE x RMS added to that replica's "
                          "parameters after STEP")
    crash_checkpoint: int = option(0, "die between writing and renaming the checkpoint of this "
                                   "step (to test that the previous one survives)")
    kill: str = option("", "REPLICA:STEP[,REPLICA:STEP...]: every rank of that replica is killed "
                       "(SIGKILL) after STEP, once, as a lost site would be; lighthouse:STEP "
                       "stops an --elastic run's Lighthouse")

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.crash_checkpoint < 0:
            raise ConfigError(f"--crash-checkpoint must be zero or positive, got {cfg.crash_checkpoint}.")
        parse_straggler(cfg.straggler, cfg.replicas)
        parse_corrupt(cfg.corrupt, cfg.replicas, cfg.steps)
        parse_kill(cfg.kill, cfg.replicas, cfg.steps, cfg.elastic)


class Faults:
    def __init__(self, cfg, replica: int, seed: int, rank: int = 0):
        self.straggler = parse_straggler(cfg.straggler, cfg.replicas)
        self.corrupt = parse_corrupt(cfg.corrupt, cfg.replicas, cfg.steps)
        self.crash_checkpoint = cfg.crash_checkpoint
        kills = parse_kill(cfg.kill, cfg.replicas, cfg.steps, cfg.elastic)
        self.kill = [k for k in kills if k[0] == replica]
        self.kill_lighthouse = [step for who, step in kills if who == LIGHTHOUSE]
        self.replica, self.seed, self.rank = replica, seed, rank

    def maybe_die(self, step: int, run_root) -> None:
        """SIGKILL this process after `step` when --kill names its replica and step, once: a
        marker in RUN/logs/ says the kill happened, so neither a restarted group nor a resumed
        run meets it again."""
        logs = Path(run_root) / "logs"
        if step in self.kill_lighthouse:
            try:  # the first rank past the step asks, once in the run, and waits until the
                # launcher has taken the request: the Lighthouse is gone before the next step
                os.close(os.open(logs / f"killed-lighthouse-step{step}", os.O_CREAT | os.O_EXCL))
                request, deadline = logs / "kill-lighthouse", time.monotonic() + 30
                request.touch()
                while request.exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
            except FileExistsError:
                pass
        if (self.replica, step) not in self.kill:
            return
        marker = logs / f"killed-replica{self.replica}-step{step}-rank{self.rank}"  # each its own
        if marker.exists():
            return
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)

    def slow_down(self, compute_s: float) -> None:
        """Make this rank's step slower if its replica is a straggler."""
        factor = self.straggler.get(self.replica, 1.0)
        if factor > 1:
            time.sleep((factor - 1) * compute_s)

    @torch.no_grad()
    def after_step(self, step: int, model: torch.nn.Module) -> bool:
        """Corrupt this replica's parameters after inner step `step` (1-based) if asked."""
        if not self.corrupt or self.corrupt[:2] != (self.replica, step):
            return False
        from torch.distributed.tensor import DTensor, distribute_tensor  # (slow to import)

        g = torch.Generator().manual_seed(self.seed + step)
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g).to(p.device, p.dtype)
            if isinstance(p, DTensor):  # sharded (edit, aedit): this rank's piece of the same noise
                noise = distribute_tensor(noise, p.device_mesh, p.placements, src_data_rank=None)
            p.add_(noise * self.corrupt[2] * p.float().pow(2).mean().sqrt().to(p.dtype))
        return True
