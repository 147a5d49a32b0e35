"""When a replica of diloco or streaming syncs: after a fixed number of inner steps, or after as
many as its speed allows (--local-steps adaptive), so that replicas of unequal speed reach each
sync together and none waits for the slowest.

fixed (the default): a sync starts after every H/P inner steps (`period`), fragment
(s / period - 1) mod P after step s, on every replica alike.

adaptive: the syncs keep their order (sync k syncs fragment k mod P) but each replica reaches
them at its own step count. Replica r runs n_r inner steps between two syncs: its rate

    rate_r = period x t_fast / t_r

(t_r its compute seconds a step since the last sync, as the loop records them in its step
events: a step's seconds less its waits for the link; the first sync's since the run began;
t_fast the fastest replica's) rounded to whole steps by error diffusion, n_r = round(rate_r +
carry_r), carry_r the rounding left over (at least tau + 1, at most `period`): the fastest runs
`period` steps, a replica twice as slow alternately 3 and 2 of a period of 5, and each period
lasts about `period` of the fastest's steps on every replica. Each replica's time travels with
sync k's exchange (an all-gather of one number a rank, started with it) and sets the steps of
the period running when sync k's average is applied (tau steps later), on every rank from the
same numbers, so every rank agrees on every replica's steps; tau + 1 steps at the least keep
each apply before the next sync. A rate moves only when its ideal is 15% of it away
(DEAD_BAND): a loaded machine's noise leaves equal replicas at `period`; a slowdown that comes
and goes moves it at the next sync. Declared speeds (--local-steps 1,0.5) set the counts once,
from the start, with nothing measured: a site known to be slower, and runs that repeat exactly.

The schedule's own clock is the *run step*: sync k (k = 1, 2, ...) starts at run step
k x period on every replica, which names evaluations, checkpoints and the learning rate's place
(a slow replica's step i of a period of n_r steps is at run step (k - 1) x period + i x
period / n_r). Pseudo-gradients merge weighted by the tokens each replica trained
(--merge-weights tokens): a fast replica's longer walk counts for more, in proportion.

--sync-every-warmup H0 (diloco, fixed steps; 0, off, by default): the first syncs come after H0,
2 H0, 4 H0, ... inner steps, doubling while below H, then every H (warm_syncs): a run's first
outer steps, when the replicas' weights move fastest, come more often, for log2(H / H0) more
syncs than H alone. Doubling rather than a linear ramp: H is reached in a few syncs, so the
warm-up costs little communication. Streaming's fragments keep a fixed rotation every H/P steps
with tau < H/P, which a growing H would reshuffle: it is refused there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowband.options import ConfigError, Options, option
from lowband.schedule import lr_at
from lowband.units import parse_duration

DEAD_BAND = 0.15  # of a period: how far a replica's ideal steps move before its count does


@dataclass
class PaceOptions(Options):
    title = "local steps"
    local_steps: str = option("fixed", "fixed: every replica runs H/P inner steps between two "
                              "syncs; adaptive: as many as its measured speed allows, so that "
                              "replicas of unequal speed reach each sync together (merged by "
                              "tokens; docs/algorithms.md); or each replica's speed declared, "
                              "SPEED,SPEED,... (1,0.5: replica 1 runs half the steps)")
    replica_accum: str = option("", "each replica's micro-batches a step, A,B,...: a site "
                                "with more GPUs trains a larger batch (2,1: replica 0 twice "
                                "replica 1's), merged by tokens. Empty: --grad-accum on every "
                                "replica")
    grace: str = option("", "with adaptive local steps: the longest a sync waits for a late "
                        "replica after the last one that reached it, e.g. 2s; the late one's "
                        "work merges at a later sync (algorithms/grace.py). Empty: wait for all")
    sync_every_warmup: int = option(0, "H0 (diloco): the first syncs after H0, 2 H0, 4 H0, ... "
                                    "inner steps, doubling while below --sync-every, then every "
                                    "H (0: off)")

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.sync_every_warmup:
            check_warmup(cfg)
        if cfg.grace:
            check_grace(cfg)
        if cfg.replica_accum:
            accums(cfg)
            if cfg.merge_weights != "tokens":
                raise ConfigError(f"--replica-accum {cfg.replica_accum} merges each replica's "
                                  "pseudo-gradient by the tokens it trained: drop "
                                  "--merge-weights uniform.")
        if cfg.local_steps == "fixed":
            return
        declared(cfg.local_steps, cfg.replicas)
        period = cfg.sync_every // cfg.fragments
        if cfg.elastic and cfg.shards != 1:
            raise ConfigError(f"--local-steps {cfg.local_steps} runs --elastic with one rank a "
                              "replica group: use --shards 1.")
        if cfg.merge_weights != "tokens":
            raise ConfigError(f"--local-steps {cfg.local_steps} merges each replica's "
                              "pseudo-gradient by the tokens it trained: drop --merge-weights "
                              "uniform.")
        for name, value in (("steps", cfg.steps), ("eval-every", cfg.eval_every),
                            ("checkpoint-every", cfg.checkpoint_every),
                            ("stop-after", cfg.stop_after)):
            if value % period:
                raise ConfigError(f"--{name} {value} is not a multiple of H/P = {period}: with "
                                  f"--local-steps {cfg.local_steps} replicas meet only at syncs, "
                                  "so runs end, evaluate and checkpoint there.")


def check_warmup(cfg) -> None:
    """--sync-every-warmup: below H, for diloco with fixed local steps."""
    h0, H = cfg.sync_every_warmup, cfg.sync_every
    if not (isinstance(h0, int) and 0 < h0 < H):
        raise ConfigError(f"--sync-every-warmup must be 0 (off) or a number of steps below "
                          f"--sync-every {H}, got {h0}.")
    if cfg.fragments != 1 or cfg.overlap != 0:
        raise ConfigError("--sync-every-warmup works with --algo diloco only: streaming's "
                          "fragments sync in turn every H/P steps with an overlap below H/P, a "
                          "rotation that a growing H would break.")
    if cfg.local_steps != "fixed":
        raise ConfigError(f"--sync-every-warmup needs --local-steps fixed: --local-steps "
                          f"{cfg.local_steps} sets each period's steps by speed.")


def warm_syncs(h0: int, H: int) -> list[int]:
    """The inner steps after which the syncs of --sync-every-warmup H0 start: H0, H0 + 2 H0,
    ..., the gap doubling while below H (the syncs after the last come every H)."""
    out, gap = [], h0
    while 0 < gap < H:
        out.append((out[-1] if out else 0) + gap)
        gap *= 2
    return out


def check_grace(cfg) -> None:
    """--grace: a duration, and a run the stand-in (algorithms/grace.py) can serve."""
    try:
        seconds = parse_duration(cfg.grace)
    except ValueError as e:
        raise ConfigError(f"--grace {cfg.grace}: {e}.") from None
    if not seconds > 0:
        raise ConfigError(f"--grace {cfg.grace} must be a positive duration, e.g. 2s.")
    why = [(cfg.local_steps == "fixed", "--local-steps adaptive (a late replica rejoins by "
            "time, not by a step count)"), (cfg.shards != 1, "--shards 1"),
           (cfg.elastic, "no --elastic (torchft's quorum has its own timeout)"),
           (cfg.time_budget is not None, "no --time-budget (its checks meet every replica)"),
           (cfg.merge_weights != "tokens", "--merge-weights tokens (a late replica weighs 0)"),
           (cfg.exchange == "two-phase", "--exchange all-gather or auto (the two-phase "
            "exchange runs a thread of its own; auto takes the all-gather with --grace)")]
    for bad, need in why:
        if bad:
            raise ConfigError(f"--grace {cfg.grace} needs {need}.")


def accums(cfg) -> list[int]:
    """Each replica's micro-batches a step: --replica-accum, or --grad-accum for every one."""
    if not getattr(cfg, "replica_accum", ""):
        return [cfg.grad_accum] * cfg.replicas
    try:
        out = [int(x) for x in cfg.replica_accum.split(",")]
    except ValueError:
        out = []
    if len(out) != cfg.replicas or not all(a > 0 for a in out):
        raise ConfigError(f"--replica-accum {cfg.replica_accum}: give one positive whole number "
                          f"of micro-batches for each of the {cfg.replicas} replicas (e.g. "
                          f"{','.join(['1'] * cfg.replicas)}).")
    return out


def declared(text: str, replicas: int) -> list[float] | None:
    """--local-steps SPEED,SPEED,...: each replica's speed (None for fixed and adaptive)."""
    if text in ("fixed", "adaptive"):
        return None
    try:
        speeds = [float(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"--local-steps '{text}' is not fixed, adaptive or one speed a "
                          "replica (SPEED,SPEED,..., e.g. 1,0.5).") from None
    if len(speeds) != replicas or not all(x > 0 for x in speeds):
        raise ConfigError(f"--local-steps {text}: give one positive speed for each of the "
                          f"{replicas} replicas (e.g. {','.join(['1'] * replicas)}).")
    return speeds


def steps_for(times: list[float], period: int, tau: int,
              now: list[int] | None = None) -> list[int]:
    """Each replica's steps in a period, from its seconds a step: the fastest's `period`, the
    others' in proportion, at least tau + 1. A replica's count moves only when its ideal is
    DEAD_BAND of a period (or a step) away from `now`'s: the noise of a loaded machine leaves
    equal replicas at `period`, a 2x straggler moves to half of it. (The planner counts with
    it too: plan/replicas.py.)"""
    now = now or [period] * len(times)
    band = max(1.0, DEAD_BAND * period)
    fastest = min(t for t in times if t > 0)
    out = []
    for t, n in zip(times, now):  # (t <= 0: nothing measured, --grace's absent: it keeps n)
        ideal = period * fastest / t if t > 0 else n
        out.append(n if abs(ideal - n) < band else
                   min(max(math.floor(ideal + 0.5), tau + 1), period))
    return out


class Pace:
    """One replica's sync schedule (module doc): which fragment's sync starts after inner step
    s, and where a step stands on the run's schedule. State: the syncs started, the step the
    last one started at, this period's steps (n), the times measured since."""

    def __init__(self, cfg, comm, measured):
        """measured(): this rank's compute seconds and steps recorded so far (the algorithm's
        compute_s and computed_steps: session.Session.stepped adds each step's)."""
        self.adaptive = cfg.local_steps != "fixed"
        self.period, self.fragments, self.tau = cfg.sync_every // cfg.fragments, cfg.fragments, \
            cfg.overlap
        if self.adaptive:  # each replica's declared speed (None: measured); the run's syncs
            self.speeds, self.total = declared(cfg.local_steps, cfg.replicas), \
                cfg.steps // self.period
        else:
            self.speeds = self.total = None
        self.comm, self.measured = comm, measured
        self.warm = warm_syncs(getattr(cfg, "sync_every_warmup", 0), self.period)
        self.grace = bool(getattr(cfg, "grace", ""))  # run steps where every replica met
        self.elastic = bool(getattr(cfg, "elastic", False))  # times through torchft's group
        self.met_at = None  # (--grace) the inner step and run step of the last sync all met
        self.took = 0.0  # the compute seconds a step sent with the last sync
        self.started = 0     # syncs started
        self.last_start = 0  # the inner step the last sync started after
        self.n = self.period  # this replica's steps in the current period
        self.steps_of = None  # every replica's n for the current period (decided at an apply)
        # measured: each replica's steps a period as a fraction (its rate) and what rounding
        # its counts to whole steps has left over (dithered)
        replicas = cfg.replicas if self.adaptive else 0
        self.rate, self.carry = [float(self.period)] * replicas, [0.0] * replicas
        if self.speeds is not None:  # declared: the same from the first period on
            self.steps_of = self.steps_for([1 / x for x in self.speeds])
            self.n = self.steps_of[comm.topo.replica]
        self.last_steps = 0  # this replica's steps in the period that ended at the last start
        self._mark = None    # measured() at the last start
        # the run steps of the period's inner steps: from inner step (0-based) `at`, run step
        # `base` and `rate` run steps an inner step (an apply that changes n starts a new piece)
        self._piece = (0, 0.0, self.period / self.n)
        self._lr = (None, 0.0)  # (step, run step) last asked: the same answer after a change

    # -- the schedule --------------------------------------------------------------------------

    def due(self, s: int) -> int | None:
        """The fragment whose sync starts after inner step s (1-based), if any."""
        if self.warm:  # (diloco: one fragment) --sync-every-warmup's syncs, then every H
            last = self.warm[-1]
            return 0 if s in self.warm or (s > last and (s - last) % self.period == 0) else None
        if not self.adaptive:
            return None if s % self.period else (s // self.period - 1) % self.fragments
        return self.started % self.fragments if s == self.last_start + self.n else None

    def run_step(self, s: int) -> int | None:
        """Where inner step s (1-based, just taken) stands on the run's schedule, when every
        replica stands there too: s (fixed), or the run step of a sync started after it."""
        if not self.adaptive:
            return s
        if self.grace:  # where the apply of a sync that every replica reached ran, the end
            if self.over() and s == self.last_start:
                return self.total * self.period
            return self.met_at[1] if self.met_at is not None and self.met_at[0] == s else None
        return self.started * self.period if s == self.last_start and self.started else None

    def position(self, step: int) -> float:
        """The run step of inner step `step` (0-based, about to be taken), for the learning
        rate and the progress bar: the same number each time the step is asked about."""
        if not self.adaptive:
            return step
        if self._lr[0] != step:
            at, base, rate = self._piece
            self._lr = (step, base + (step - at) * rate)
        return self._lr[1]

    def over(self) -> bool:
        """adaptive: the run's last sync has started."""
        return self.started >= self.total

    # -- at a sync -----------------------------------------------------------------------------

    def start(self, s: int, send: bool = True):
        """Sync `self.started` starts after inner step s: the measured step time leaves with it
        (a Transfer; None with fixed steps; not `send`: the seconds, which --grace's stand-in
        sends), to decide the next period at its apply."""
        self.started += 1
        if not self.adaptive:
            return None
        self.last_steps, self.last_start = s - self.last_start, s
        if self.steps_of is not None:  # its own count (an --elastic heal brings a peer's)
            self.n = self.steps_of[self.comm.topo.replica]
        self._piece = (s, float(self.started * self.period), self.period / self.n)
        if self.speeds is not None:  # declared: nothing to measure
            return None if send else 0.0
        now = self.measured()  # (compute seconds, steps) recorded so far
        if self._mark is None and self.started == 1:  # a fresh run's first: since it began
            self._mark = (0.0, 0)
        took = 0.0
        if self._mark is not None and now[1] > self._mark[1]:
            took = (now[0] - self._mark[0]) / (now[1] - self._mark[1])
        self._mark, self.took = now, took or self.took
        if not send:
            return took
        if self.elastic:  # the quorum's groups: each says which it is
            mine = torch.tensor([float(self.comm.topo.replica), took], dtype=torch.float64)
            return self.comm.membership.all_gather(self.comm, mine, "pace")
        mine = torch.tensor([took], dtype=torch.float64)
        return self.comm.all_gather(mine, "world", tag="pace")

    def decide(self, times, s: int | None) -> None:
        """At a sync's apply, after inner step s: every replica's steps for the period now
        running, from the times every rank sent (a replica's: its slowest rank's), the same on
        every rank; the period's remaining steps spread over its remaining run steps. s None:
        a sync this replica missed (--grace): every replica's steps only, its own stay."""
        if times is None:
            return
        got = times.wait()
        if len(got) and got[0].numel() == 2:  # --elastic: (replica, time) of the quorum's groups;
            per_replica = [-1.0] * self.comm.topo.replicas  # the others keep their counts
            for row in got:
                per_replica[int(row[0])] = float(row[1])
        else:
            per_rank = [float(t) for t in got]
            shards = len(per_rank) // self.comm.topo.replicas
            per_replica = [max(per_rank[r * shards:(r + 1) * shards])
                           for r in range(self.comm.topo.replicas)]
        if max(per_replica) <= 0 or min(per_replica) == 0:  # a resumed run's first: nothing
            return                                          # measured before it
        self.steps_of = self.dithered(per_replica)
        if s is None:
            return
        self.n = self.steps_of[self.comm.topo.replica]
        end = (self.started + 1) * self.period  # the next sync's run step: the period's end
        here = self.position(s)
        self._piece = (s, here, (end - here) / (self.last_start + self.n - s))

    def rejoin(self, s: int, target: int, steps: int) -> None:
        """(--grace) A late replica goes on after inner step s towards sync `target`, reached
        after `steps` more inner steps; the syncs before it were missed."""
        here = self.position(s)
        self.started, self.last_start, self.n = target - 1, s, steps
        self._piece = (s, here, max(target * self.period - here, 0.0) / steps)

    def dithered(self, times: list[float]) -> list[int]:
        """Each replica's steps for the period now running, from its seconds a step (t <= 0:
        nothing measured, it keeps its rate): its rate, period x t_fast / t, moves when the
        ideal is DEAD_BAND of it away (the noise of a loaded machine leaves it), and the count
        is the rate plus what earlier counts' rounding left over, rounded (error diffusion):
        a rate of 2.5 runs 3, 2, 3, 2, ... steps, so that a replica is never more than half a
        step early or late, and streaming's overlap (tau steps after the start) hides what is
        late, where a count of 2 every period would wait half a step each time."""
        fastest = min(t for t in times if t > 0)
        out = []
        for r, t in enumerate(times):
            ideal = self.period * fastest / t if t > 0 else self.rate[r]
            if abs(ideal - self.rate[r]) >= DEAD_BAND * self.rate[r]:
                self.rate[r] = ideal
            x = self.rate[r] + self.carry[r]
            n = min(max(math.floor(x + 0.5), self.tau + 1), self.period)
            self.carry[r] = min(max(x - n, -1.0), 1.0)
            out.append(n)
        return out

    def steps_for(self, times: list[float], now: list[int] | None = None) -> list[int]:
        """Each replica's steps in a period of this run (steps_for, below)."""
        return steps_for(times, self.period, self.tau, now)

    def sync_step(self, started_at: int) -> int:
        """The run step of the sync in flight, started after inner step `started_at` (until
        the next starts): where every replica's sync events meet."""
        return self.started * self.period if self.adaptive else started_at

    def fields(self) -> dict:
        """What a sync event records of the schedule (adaptive): the inner step this replica
        started it after, its steps in the period that ended, every replica's for the period
        that began (decided at this apply)."""
        if not self.adaptive:
            return {}
        return {"inner_step": self.last_start, "local_steps": self.last_steps,
                "steps_of": self.steps_of}

    def state_dict(self) -> dict:
        return {"started": self.started, "last_start": self.last_start, "n": self.n,
                "steps_of": self.steps_of, "last_steps": self.last_steps,
                "piece": list(self._piece), "rate": self.rate, "carry": self.carry}

    def load_state_dict(self, state: dict | None) -> None:
        if state:  # (a checkpoint from before adaptive steps: fixed, nothing to restore)
            self.started, self.last_start = state["started"], state["last_start"]
            self.n, self.steps_of = state["n"], state["steps_of"]
            self.last_steps = state["last_steps"]
            self._piece, self._mark, self._lr = tuple(state["piece"]), None, (None, 0.0)
            self.rate = list(state.get("rate", self.rate))
            self.carry = list(state.get("carry", self.carry))


class Paced:
    """The hooks of an algorithm whose syncs a Pace schedules (`self.pace`; diloco and
    streaming), mixed in before Algorithm: with adaptive steps replicas run different step
    counts, so the schedule decides the run's end and names its evaluations, checkpoints and
    the learning rate's place; with fixed steps each is Algorithm's."""
    pace: Pace

    def should_stop(self, step: int) -> bool:
        return self.pace.over() if self.pace.adaptive else super().should_stop(step)

    def ends_after(self, step: int) -> bool:
        return self.pace.over() if self.pace.adaptive else super().ends_after(step)

    def run_step(self, s: int) -> int | None:
        return self.pace.run_step(s)

    def lr_step(self, step: int) -> float:
        return self.pace.position(step)

    def lr(self, step: int) -> float:
        """(--time-budget: the budget's fraction is read at the run step, as the clock counts)"""
        at = self.lr_step(step)
        return lr_at(self.config, at, None if self.clock is None else self.clock.fraction(at))

    def progress_steps(self, step: int) -> float:
        return self.pace.position(step) + 1

    def micro_batches(self) -> int:
        if not getattr(self.config, "replica_accum", ""):
            return super().micro_batches()
        return accums(self.config)[self.topo.replica]

    def quorum_progress(self, step: int) -> int:
        """--elastic: the run step of the sync about to start (replicas' inner steps differ,
        so a quorum compares where they are on the run's schedule; a fresh group's is 0)."""
        if not self.pace.adaptive:
            return super().quorum_progress(step)
        return (self.pace.started + 1) * self.pace.period if step else 0
