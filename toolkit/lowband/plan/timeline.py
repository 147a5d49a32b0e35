"""The schedule of each algorithm, and the event-driven timeline that replays it on one link.

Time advances in *units* of compute: a step (forward 1/3, backward 2/3), or for acco one
round's share of a step. A unit may release transfers at offsets inside it (or, chained, when
the transfer before it has arrived); a transfer names the unit that cannot start before it
arrives (its gate). The link is lowband.comm.link's: transfers queue first in, first out, each
occupies the link for its wire bits / bandwidth, and arrives one latency after that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from lowband.comm.wire import wire_bytes
from lowband.plan.inputs import ALGORITHMS, GRAD_DTYPES, PlanError, Run, exchange_phases, plan_as


class Send(NamedTuple):
    offset: float          # released this many seconds into its unit...
    nbytes: float          # wire bytes this replica sends
    gate: int              # the unit this many units later waits for its arrival
    chained: bool = False  # ...or, if chained, when the send before it has arrived


@dataclass(frozen=True)
class Schedule:
    """What one algorithm sends, and what waits for it."""
    unit_s: float                     # compute time of one unit (a step; for acco a round's)
    units_per_step: int
    period: int                       # the send pattern repeats every `period` units
    offsets: tuple[int, ...]          # units (mod period) that send, in increasing order
    sends: tuple[tuple[Send, ...], ...]  # what the unit at each offset sends, in this order

    def every(self):
        return (send for sends in self.sends for send in sends)


def average(run: Run, values: int, gate: int) -> tuple[Send, ...]:
    """The collectives of one average of `values` values in the run's codec, released at the end
    of a step: each phase of the exchange pays its own latency, the next once it has arrived."""
    phases = exchange_phases(run, values)
    return tuple(Send(0.0 if i else run.step_time, w, gate, chained=i > 0)
                 for i, w in enumerate(phases))


def schedule(algorithm: str, run: Run) -> Schedule:
    """The schedule of an algorithm (docs/plan.md has the formulas)."""
    algorithm = plan_as(algorithm)
    T, N, R = run.step_time, run.params, run.replicas
    grad = N * GRAD_DTYPES[run.grad_dtype]
    if algorithm == "ddp":  # buckets leave during the backward pass; next forward waits for all
        # one bucket per block, or buckets of bucket_mb MiB of fp32 gradients (lowband's ddp)
        n = run.layers if run.bucket_mb is None else math.ceil(N * 4 / (run.bucket_mb * 2**20))
        sends = tuple(Send(T / 3 + (k + 1) / n * 2 * T / 3, wire_bytes("all_reduce", grad / n, R),
                           1) for k in range(n))
        s = Schedule(T, 1, 1, (0,), (sends,))
    elif algorithm == "diloco":  # the whole model after every H-th step, waited for at once
        s = Schedule(T, 1, run.sync_every, (run.sync_every - 1,),
                     (average(run, sum(run.fragment_sizes), 1),))
    elif algorithm == "streaming":  # fragment p after steps floor((p+1)H/P) - 1 (mod H), tau late
        H, P = run.sync_every, run.fragments
        s = Schedule(T, 1, H, tuple((p + 1) * H // P - 1 for p in range(P)),
                     tuple(average(run, n, 1 + run.overlap) for n in run.fragment_sizes))
    elif algorithm == "acco":  # per round: reduce-scatter, then all-gather, behind one round
        u = T / run.acco_rounds
        rs, ag = wire_bytes("reduce_scatter", grad, R), wire_bytes("all_gather", grad / R, R)
        s = Schedule(u, run.acco_rounds, 1, (0,), ((Send(u, rs, 2), Send(0.0, ag, 2, True)),))
    else:
        raise PlanError(f"unknown algorithm '{algorithm}': plan models {', '.join(ALGORITHMS)}.")
    if R == 1:  # nothing crosses the link
        s = Schedule(s.unit_s, s.units_per_step, s.period, (), ())
    return s


class Timeline:
    """One replica's compute and its link, advanced unit by unit through the units that send or
    wait (the others only move the clock). Replicas are symmetric, so one stands for all."""

    def __init__(self, s: Schedule, bandwidth: float, latency: float):
        self.s, self.bandwidth, self.latency = s, bandwidth, latency
        self.offsets = s.offsets
        self.clock = 0.0  # when unit `next` may start, inputs aside
        self.next = 0     # the first unit not started yet
        self.link = 0.0   # when the link is free
        self.gates: dict[int, float] = {}  # unit -> when the transfers it waits for arrive
        self.k = 0        # index of the next sending unit

    def advance(self, until: int) -> float:
        """Run units next..until-1; return the stall before them."""
        s, stalled = self.s, 0.0
        while True:
            q, r = divmod(self.k, len(self.offsets)) if self.offsets else (math.inf, 0)
            send = q * s.period + (self.offsets[r] if self.offsets else 0)
            u = min(send, min(self.gates, default=math.inf))
            if u >= until:
                break
            self.clock += (u - self.next) * s.unit_s
            start = max(self.clock, self.gates.pop(u, 0.0))
            stalled += start - self.clock
            if u == send:
                self.k += 1
                arrive = start
                for send in s.sends[r]:  # first in, first out
                    release = arrive if send.chained else start + send.offset
                    self.link = max(self.link, release) + send.nbytes * 8 / self.bandwidth
                    arrive = self.link + self.latency
                    g = u + send.gate
                    self.gates[g] = max(self.gates.get(g, 0.0), arrive)
            self.clock, self.next = start + s.unit_s, u + 1
        self.clock += (until - self.next) * s.unit_s
        self.next = until
        return stalled

    def drain(self) -> float:
        """The wait, after the last unit, for every transfer still in flight."""
        return max([0.0] + [t - self.clock for t in self.gates.values()])

    def state(self) -> list[float]:
        """Link and pending arrivals relative to the clock: equal states, equal futures."""
        pending = sorted((g - self.next, max(0.0, t - self.clock)) for g, t in self.gates.items())
        return [max(0.0, self.link - self.clock)] + [x for pair in pending for x in pair]


def steady_stall(s: Schedule, bandwidth: float, latency: float) -> tuple[int, float]:
    """(units, stall) of one chunk of whole periods once the timeline repeats itself."""
    timeline = Timeline(s, bandwidth, latency)
    max_gate = max((send.gate for send in s.every()), default=1)
    chunk = s.period * math.ceil(16 / s.period)
    timeline.advance(s.period * math.ceil((max_gate + 1) / s.period))
    previous, tol = None, 1e-9 * chunk * s.unit_s
    for _ in range(max(4, 20_000 // chunk)):  # a link that barely keeps up fills slowly
        stall = timeline.advance(timeline.next + chunk)
        now = [stall] + timeline.state()
        if previous is not None and len(now) == len(previous) and all(
                abs(x - y) <= tol for x, y in zip(now, previous)):
            break
        previous = now
    return chunk, stall
