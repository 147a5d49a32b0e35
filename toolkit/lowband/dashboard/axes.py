"""Where a point lies on the loss figure's x axes (style.XAXES): its step, the run's tokens, the
run's training seconds (wall-clock time) or the outer-link bytes the run had sent by then.

LossAxes is a part of RunModel (it reads replicas, outer, t0 and _val; calls _cached,
run_tokens and val_series). Training seconds are the step and eval events' `elapsed_s`: the
training loop's time, without evaluations, checkpoints or the time between the attempts of a
resumed run, so that a run's curve ends at its summary's wall_s and time to target reads off it;
a run written before they existed falls back to the seconds since its first event. The outer
bytes of an evaluation are its event's `outer_bytes`; elsewhere, the outer `comm` events of
every rank that had ended by then.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate


class LossAxes:
    """RunModel's x axes of the loss figure (a mixin)."""

    def x_of(self, xaxis: str, step: int | None, t: float | None, replica: int,
             tokens: float | None = None, clock: float | None = None):
        """x of a point of replica `replica`: at `step` (None where unknown), at unix time t;
        tokens: that replica's at the point, clock: the run's training seconds, where known
        (else found from the step or the time). None where it cannot be placed."""
        rs = self.replicas.get(replica)
        if xaxis == "tokens":
            if tokens is None and rs is not None and step is not None:
                tokens = rs.tokens_at(step)
            return None if tokens is None else self.run_tokens(tokens)
        if xaxis == "time":
            return clock if clock is not None else self.clock_at(t, replica)
        if xaxis == "bytes":
            return None if t is None else self.outer_bytes_at(t)
        return step

    def clock_at(self, t: float | None, replica: int = 0) -> float | None:
        """The run's training seconds at unix time t, by that replica's steps (another's if it
        has none); seconds since the first event for a run whose steps carry no clock."""
        if t is None:
            return None
        mine = self.replicas.get(replica)
        for rs in ([mine] if mine is not None else []) + list(self.replicas.values()):
            clock = rs.clock_at(t)
            if clock is not None:
                return clock
        return t - (self.t0 or 0.0)

    def outer_bytes_at(self, t: float) -> float:
        """Outer-link wire bytes of all ranks' transfers that had ended by unix time t."""
        ends, total = self._cached("outer_by_end", self._outer_by_end)
        i = bisect_right(ends, t)
        return total[i - 1] if i else 0.0

    def _outer_by_end(self) -> tuple[list[float], list[float]]:
        done = sorted((tr.end, tr.wire_bytes) for tr in self.outer)
        return [end for end, _ in done], list(accumulate(wire for _, wire in done))

    def val_x(self, xaxis: str) -> list:
        """x of each validation point (val_series' order): what its eval events say it took
        (elapsed_s, tokens, outer_bytes) where they say it."""
        steps, _, ts, toks = self.val_series()
        if xaxis == "step":
            return steps
        if xaxis == "tokens":
            return toks
        key = "elapsed_s" if xaxis == "time" else "outer_bytes"
        return [self._val[step][4].get(key, self.x_of(xaxis, step, t, self._val[step][3]))
                for step, t in zip(steps, ts)]
