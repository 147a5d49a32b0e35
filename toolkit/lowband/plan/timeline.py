"""The event-driven timeline that replays an algorithm's schedule on one link.

Each algorithm declares its schedule (its class's outer_link, comm/sends.py: units of compute,
the transfers each releases and the units that wait for them). The link is lowband.comm.link's:
transfers queue first in, first out, each occupies the link for its wire bits / bandwidth, and
arrives one latency after that.
"""

from __future__ import annotations

import math

from lowband.algorithms import ALGORITHMS as REGISTRY
from lowband.comm.sends import Run, Schedule
from lowband.plan.inputs import PlanError, modeled


def schedule(algorithm: str, run: Run) -> Schedule:
    """What the algorithm declares it sends (its class's outer_link; docs/plan.md has the
    formulas); nothing on the link with one replica."""
    s = REGISTRY[algorithm].outer_link(run) if algorithm in REGISTRY else None
    if s is None:
        raise PlanError(f"lowband plan does not model --algo {algorithm}: it models "
                        f"{', '.join(modeled())} (an algorithm's class declares outer_link).")
    return s.quiet() if run.replicas == 1 else s


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
        while self.offsets and self._unit(self.k) < s.first:
            self.k += 1

    def _unit(self, k: int) -> int:
        q, r = divmod(k, len(self.offsets))
        return q * self.s.period + self.offsets[r]

    def advance(self, until: int) -> float:
        """Run units next..until-1; return the stall before them."""
        s, stalled = self.s, 0.0
        while True:
            send = self._unit(self.k) if self.offsets else math.inf
            u = min(send, min(self.gates, default=math.inf))
            if u >= until:
                break
            self.clock += (u - self.next) * s.unit_s
            start = max(self.clock, self.gates.pop(u, 0.0))
            stalled += start - self.clock
            if u == send:
                arrivals: list[float] = []
                for send in s.sends[self.k % len(self.offsets)]:  # first in, first out
                    release = arrivals[send.after] if send.after >= 0 else start + send.offset
                    self.link = max(self.link, release) + send.nbytes * 8 / self.bandwidth
                    arrivals.append(self.link + self.latency)
                    g = u + send.gate
                    self.gates[g] = max(self.gates.get(g, 0.0), arrivals[-1])
                self.k += 1
            self.clock, self.next = start + s.unit_s, u + 1
        self.clock += (until - self.next) * s.unit_s
        self.next = until
        return stalled

    def run(self, until: int) -> float:
        """advance(until) for a whole run: once a chunk of whole periods repeats the one before
        it (the same stall, the same backlog), the repeats up to the last chunks are counted,
        not replayed. Returns the stall."""
        chunk = self.s.period * math.ceil(16 / self.s.period)
        stalled, previous = 0.0, None
        while until - self.next > 2 * chunk:
            stall = self.advance(self.next + chunk)
            stalled += stall
            now = [stall] + self.state()
            if previous is not None and _same(now, previous, 1e-9 * chunk * self.s.unit_s):
                n = (until - self.next - chunk) // chunk
                self._shift(n * chunk, n * (chunk * self.s.unit_s + stall))
                stalled += n * stall
                break
            previous = now
        return stalled + self.advance(until)

    def _shift(self, units: int, dt: float) -> None:
        """Move the timeline `units` units (whole periods) and dt seconds on, as replaying them
        would once it repeats itself."""
        self.clock, self.link, self.next = self.clock + dt, self.link + dt, self.next + units
        self.gates = {g + units: t + dt for g, t in self.gates.items()}
        self.k += units // self.s.period * len(self.offsets)

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
        if previous is not None and _same(now, previous, tol):
            break
        previous = now
    return chunk, stall


def _same(now: list[float], before: list[float], tol: float) -> bool:
    return len(now) == len(before) and all(abs(x - y) <= tol for x, y in zip(now, before))
