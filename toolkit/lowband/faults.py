"""Fault injectors that work with every algorithm, for experiments, tests and benchmarks.

--straggler REPLICA:FACTOR[,REPLICA:FACTOR...]  the ranks of each REPLICA compute FACTOR x
                             slower: after each step they sleep (FACTOR - 1) x the step's
                             compute time (counted as compute); 0:1,1:2,2:4 sites of 3 speeds
--slowdown REPLICA:FACTOR:SECONDS[:GAP][,...]  REPLICA computes FACTOR x slower (as --straggler
                             does, the factors multiply) for SECONDS at a time, at random times
                             on the run's training clock (clock.py: evaluations and checkpoints
                             left out) with on average GAP (default 3 x SECONDS) between two:
                             the gaps are exponential, drawn from --seed and the replica, so a run
                             repeats them and a resumed one continues them from its clock's
                             seconds. A step is slowed when a slowdown is on at its end; `fault`
                             events (what=slowdown, phase start and end) say who was slow, when
--pause REPLICA:STEP:SECONDS[,...]  after inner step STEP every rank of REPLICA sleeps SECONDS,
                             as a node that stalls without dying (a `fault` event, what=pause).
                             A stall is not compute: it is training time lost (the clock and
                             summary.json's wall_s count it), but neither the step's step_s nor
                             its compute_s (nor summary.json's compute_s): it shows as wall time
                             that is neither compute nor a link wait, and the event says where it
                             went. (The other replicas' waits for it are link waits, as always;
                             --local-steps adaptive measures a replica's speed from its steps'
                             compute_s, so a stall does not make it look slower.) A resumed run
                             that takes STEP again pauses again
--corrupt REPLICA:STEP[-LAST][:HOW]  REPLICA goes bad at inner step STEP (each step STEP..LAST):
                             HOW is SCALE or noise:SCALE (default 1): after the step, Gaussian
                             noise of SCALE x each tensor's RMS is added to its parameters, a bad
                             update that gradient clipping cannot undo, so the loss spikes (a
                             flipped bit, a failing card); or what it sends at the first sync
                             that starts after STEP (each sync that starts after a step in
                             STEP..LAST) is corrupted, as a faulty or hostile member's would be
                             (once: a marker in RUN/logs/, as --kill's):
                             flip (its pseudo-gradient negated), scale:X (times X, e.g. -10),
                             nan (NaN in it). diloco and streaming send pseudo-gradients; the
                             sent kinds are refused for the others. A `fault` event says when
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

import itertools
import math
import os
import random
import signal
import time
from collections.abc import Iterator
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


SENT_CORRUPTIONS = ("flip", "scale", "nan")  # --corrupt kinds of what a replica sends


@dataclass(frozen=True)
class Corruption:
    """One --corrupt: `replica` is bad at steps first..last; `how` noise (its parameters, value
    the noise's scale) or one of SENT_CORRUPTIONS (what it sends; value scale's factor)."""
    replica: int
    first: int
    last: int
    how: str
    value: float

    @property
    def sent(self) -> bool:
        return self.how in SENT_CORRUPTIONS


def parse_corrupt(text: str, replicas: int, steps: int) -> Corruption | None:
    """--corrupt REPLICA:STEP[-LAST][:HOW] (module doc)."""
    if not text:
        return None
    form = ("REPLICA:STEP[-LAST][:HOW], HOW a noise scale, noise:SCALE, flip, scale:X or nan, "
            "e.g. 1:50:2 or 1:40-80:scale:-10")
    parts = text.split(":")
    try:
        replica = int(parts[0])
        first, _, last = parts[1].partition("-")
        first, last = int(first), int(last or first)
        how, value = "noise", 1.0
        rest = parts[2:]
        if len(rest) == 1 and rest[0] in ("flip", "nan"):
            how, value = rest[0], -1.0 if rest[0] == "flip" else math.nan
        elif len(rest) == 2 and rest[0] in ("noise", "scale"):
            how, value = rest[0], float(rest[1])
        elif len(rest) == 1:
            value = float(rest[0])
        elif rest:
            raise ValueError
    except (ValueError, IndexError):
        raise ConfigError(f"cannot read --corrupt '{text}': write it as {form}.") from None
    if not 0 <= replica < replicas or not 1 <= first <= last <= steps:
        raise ConfigError(f"--corrupt {text}: the replica must be in 0..{replicas - 1} and the "
                          f"step in 1..{steps} (a range's last not before its first).")
    if how == "noise" and not value > 0 or how == "scale" and not math.isfinite(value):
        raise ConfigError(f"--corrupt {text}: the {'noise' if how == 'noise' else 'factor'} "
                          f"must be {'positive' if how == 'noise' else 'a finite number'}.")
    return Corruption(replica, first, last, how, value)


@dataclass(frozen=True)
class Slowdown:
    """One --slowdown: REPLICA computes FACTOR x slower for SECONDS at a time, GAP apart on
    average; `index` tells apart two of the same replica (each its own draws)."""
    replica: int
    factor: float
    seconds: float
    gap: float
    index: int = 0

    def windows(self, seed: int) -> Iterator[tuple[float, float]]:
        """Its windows (start, end) in training seconds, in order, without end: the gaps before
        them exponential with mean GAP, drawn from seed, replica and index alone (a string seed
        is hashed the same in every process), so every rank of the replica and a resumed run
        see the same ones."""
        rng = random.Random(f"slowdown:{seed}:{self.replica}:{self.index}")
        t = 0.0
        while True:
            t += rng.expovariate(1 / self.gap)
            yield t, t + self.seconds
            t += self.seconds


def slowdown_windows(slowdown: Slowdown, seed: int, until: float) -> list[tuple[float, float]]:
    """The windows of `slowdown` that start before `until` training seconds."""
    return list(itertools.takewhile(lambda w: w[0] < until, slowdown.windows(seed)))


def parse_slowdown(text: str, replicas: int) -> list[Slowdown]:
    """--slowdown REPLICA:FACTOR:SECONDS[:GAP][,...] (GAP's default: 3 x SECONDS)."""
    out, seen = [], {}
    for part in filter(None, text.split(",")):
        values = _parse(part, "--slowdown", "REPLICA:FACTOR:SECONDS[:GAP][,...], e.g. 1:4:10 or "
                        "1:4:10:60", (int, float, float, float), 3)
        replica, factor, seconds = values[:3]
        gap = values[3] if len(values) == 4 else 3 * seconds
        if not 0 <= replica < replicas or not factor >= 1 or not seconds > 0 or not gap > 0:
            raise ConfigError(f"--slowdown {part}: the replica must be in 0..{replicas - 1}, the "
                              "factor at least 1, and the seconds and the gap positive.")
        seen[replica] = seen.get(replica, -1) + 1
        out.append(Slowdown(replica, factor, seconds, gap, seen[replica]))
    return out


def parse_pause(text: str, replicas: int, steps: int) -> list[tuple[int, int, float]]:
    """--pause REPLICA:STEP:SECONDS[,...]: (replica, step, seconds) triples."""
    out = []
    for part in filter(None, text.split(",")):
        replica, step, seconds = _parse(part, "--pause", "REPLICA:STEP:SECONDS[,...], e.g. "
                                        "1:20:30", (int, int, float), 3)
        if not 0 <= replica < replicas or not 1 <= step <= steps or not seconds > 0:
            raise ConfigError(f"--pause {part}: the replica must be in 0..{replicas - 1}, the "
                              f"step in 1..{steps} and the seconds positive.")
        out.append((replica, step, seconds))
    return out


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
    slowdown: str = option("", "REPLICA:FACTOR:SECONDS[:GAP][,...]: that replica computes "
                           "FACTOR x slower for SECONDS of training time at a time, at random "
                           "times (from --seed) on average GAP apart (default 3 x SECONDS)")
    pause: str = option("", "REPLICA:STEP:SECONDS[,...]: every rank of that replica stalls "
                        "SECONDS after STEP (time lost, not compute)")
    corrupt: str = option("", "REPLICA:STEP[-LAST][:HOW]: that replica goes bad after STEP (or "
                          "each of STEP..LAST): noise of SCALE x RMS added to its parameters "
                          "(HOW: SCALE or noise:SCALE), or what it sends at the next sync "
                          "corrupted (flip, scale:X, nan)")
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
        parse_slowdown(cfg.slowdown, cfg.replicas)
        parse_pause(cfg.pause, cfg.replicas, cfg.steps)
        corrupt = parse_corrupt(cfg.corrupt, cfg.replicas, cfg.steps)
        if corrupt is not None and corrupt.sent and cfg.algo not in ("diloco", "streaming"):
            raise ConfigError(f"--corrupt {cfg.corrupt}: only diloco and streaming send "
                              f"pseudo-gradients to corrupt; use noise with --algo {cfg.algo}.")
        parse_kill(cfg.kill, cfg.replicas, cfg.steps, cfg.elastic)


class Faults:
    def __init__(self, cfg, replica: int, seed: int, rank: int = 0):
        self.straggler = parse_straggler(cfg.straggler, cfg.replicas)
        # this replica's slowdowns, each [Slowdown, its windows, the next window, on]
        self.slowdowns = []
        for slowdown in parse_slowdown(cfg.slowdown, cfg.replicas):
            if slowdown.replica == replica:
                windows = slowdown.windows(seed)
                self.slowdowns.append([slowdown, windows, next(windows), False])
        self.pauses = [(step, seconds) for who, step, seconds
                       in parse_pause(cfg.pause, cfg.replicas, cfg.steps) if who == replica]
        self.corrupt = parse_corrupt(cfg.corrupt, cfg.replicas, cfg.steps)
        self.sent_once = False  # a one-step corruption of what is sent: done (in this process)
        self.logs: Path | None = None  # RUN/logs, where the trainer has one: a marker says so for
        # a resumed run too
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

    def slow_down(self, step: int, compute_s: float, seconds: float, events) -> float:
        """After inner step `step` (1-based) of `compute_s` seconds, at `seconds` of training
        time: sleep as long as this replica's straggler factor times the slowdowns on now make
        the step (counted as its compute), then stall if --pause names the step. Returns the
        seconds stalled, which the caller leaves out of the step's time (module doc)."""
        factor = self.straggler.get(self.replica, 1.0) * self._slowdowns(step, seconds, events)
        if factor > 1:
            time.sleep((factor - 1) * compute_s)
        stalled = 0.0
        for at, pause in self.pauses:
            if at == step:
                events.emit("fault", step=step, what="pause", seconds=pause)
                t0 = time.perf_counter()
                time.sleep(pause)
                stalled += time.perf_counter() - t0
        return stalled

    def _slowdowns(self, step: int, seconds: float, events) -> float:
        """The product of this replica's slowdowns on at `seconds`, with a `fault` event where
        one starts or ends (a window wholly between two steps' ends slows none of them)."""
        factor = 1.0
        for entry in self.slowdowns:
            slowdown, windows, (start, end), on = entry
            while end <= seconds:  # past this window: to the next one that has not ended
                if on:
                    events.emit("fault", step=step, what="slowdown", phase="end",
                                factor=slowdown.factor, seconds=slowdown.seconds,
                                elapsed_s=seconds)
                    on = False
                entry[2] = next(windows)
                start, end = entry[2]
            if start <= seconds and not on:
                events.emit("fault", step=step, what="slowdown", phase="start",
                            factor=slowdown.factor, seconds=slowdown.seconds, elapsed_s=seconds)
                on = True
            entry[3] = on
            factor *= slowdown.factor if on else 1.0
        return factor

    @torch.no_grad()
    def corrupt_sent(self, step: int, x: torch.Tensor, events) -> bool:
        """Corrupt `x`, what this replica sends at a sync that starts after inner step `step`,
        if --corrupt says so (in place; a `fault` event)."""
        c = self.corrupt
        if c is None or not c.sent or c.replica != self.replica or step < c.first:
            return False
        if c.first == c.last:
            marker = None if self.logs is None else \
                self.logs / f"corrupted-replica{c.replica}-step{c.first}-rank{self.rank}"
            if self.sent_once or marker is not None and marker.exists():
                return False
            self.sent_once = True
            if marker is not None:
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.touch()
        elif step > c.last:
            return False
        if c.how == "nan":
            x.view(-1)[0] = math.nan
        else:
            x.mul_(c.value)
        if events is not None:
            events.emit("fault", step=step, what="corrupt", how=c.how, scale=c.value)
        return True

    @torch.no_grad()
    def after_step(self, step: int, model: torch.nn.Module) -> bool:
        """Corrupt this replica's parameters after inner step `step` (1-based) if asked."""
        c = self.corrupt
        if c is None or c.how != "noise" or c.replica != self.replica or \
                not c.first <= step <= c.last:
            return False
        from torch.distributed.tensor import DTensor, distribute_tensor  # (slow to import)

        g = torch.Generator().manual_seed(self.seed + step)
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g).to(p.device, p.dtype)
            if isinstance(p, DTensor):  # sharded (edit, aedit): this rank's piece of the same noise
                noise = distribute_tensor(noise, p.device_mesh, p.placements, src_data_rank=None)
            p.add_(noise * c.value * p.float().pow(2).mean().sqrt().to(p.dtype))
        return True
