"""Loss curves: each replica's mean loss per step, and the detector that flags loss spikes.

ReplicaSeries collects the step events of one replica's ranks and closes a step once they have
all reported it; SpikeDetector scores each closed point against exponentially weighted
statistics (docs/dashboard.md, "loss spike").
"""

from __future__ import annotations

import math
from bisect import bisect_right

from .records import Spike


class SpikeDetector:
    """Flags a loss that jumps above what its exponentially weighted statistics predict.

    The prediction is an EWMA of the loss with a trend term (Holt's double exponential
    smoothing: level weight alpha, trend weight beta), so that the fast fall of early training
    is not mistaken for noise; the spread is an EWMA of the squared prediction errors (weight
    alpha). z = (loss - prediction) / spread; a point with z > threshold after `warmup` points is
    a spike. Only upward jumps count. A flagged point is folded into the statistics clipped to
    the threshold, so one spike does not blind the detector while a lasting shift is absorbed.
    The spread is floored at min_std_frac of the level so a very smooth curve does not turn
    every wiggle into a spike.
    """

    def __init__(self, z: float = 5.0, alpha: float = 0.05, warmup: int = 20,
                 min_std_frac: float = 0.002, level_alpha: float = 0.3, beta: float = 0.1):
        self.threshold, self.alpha, self.warmup, self.min_std_frac = z, alpha, warmup, min_std_frac
        self.level_alpha, self.beta = level_alpha, beta
        self.level: float | None = None
        self.trend = 0.0
        self.var = 0.0
        self.n = 0

    @property
    def std(self) -> float:
        return max(math.sqrt(self.var), self.min_std_frac * abs(self.level or 0.0), 1e-12)

    def update(self, x: float) -> tuple[float, bool]:
        """Score x against the statistics so far, then fold it in. Returns (z, is_spike)."""
        if self.level is None:
            self.level, self.n = x, 1
            return 0.0, False
        forecast = self.level + self.trend
        z = (x - forecast) / self.std
        spike = self.n >= self.warmup and z > self.threshold
        if spike:
            x = forecast + self.threshold * self.std
        err = x - forecast
        a, b = self.level_alpha, self.beta
        level = forecast + a * err
        self.trend += b * (level - self.level - self.trend)
        self.level = level
        # the first errors say little (level and trend still settling): average them plainly
        w = max(self.alpha, 1.0 / self.n)
        self.var += w * (err * err - self.var)
        self.n += 1
        return z, spike


def warmup_text(warmup: int) -> str:
    """What the spike count leaves out: the points before the detector has its statistics."""
    return f"the detector's warm-up: each replica's first {warmup} steps are not judged"


def detect_spikes(losses, z: float = 5.0, alpha: float = 0.05, warmup: int = 20) -> list[int]:
    """Indices of the points in a loss series that SpikeDetector flags."""
    det = SpikeDetector(z, alpha, warmup)
    return [i for i, x in enumerate(losses) if det.update(float(x))[1]]


class ReplicaSeries:
    """One replica's loss curve: the mean over that replica's ranks, one point per step."""

    def __init__(self, replica: int, detector: SpikeDetector):
        self.replica = replica
        self.steps: list[int] = []
        self.tokens: list[float] = []     # that replica's tokens (sum over its ranks)
        self.t: list[float] = []          # when the last of its ranks finished the step
        # the run's training seconds then (step events' elapsed_s; None for older runs)
        self.clock: list[float | None] = []
        self.loss: list[float] = []
        self.spikes: list[Spike] = []
        self.detector = detector
        self.pending: dict[int, list] = {}   # step -> [loss_sum, n, t_max, tokens_sum, clock]
        self.ranks: set[int] = set()

    def tokens_at(self, step: int) -> float | None:
        i = bisect_right(self.steps, step) - 1
        return self.tokens[i] if i >= 0 else (self.tokens[0] if self.tokens else None)

    def step_at(self, t: float) -> int | None:
        """The step this replica had reached at time t (for marks known only by time)."""
        i = bisect_right(self.t, t) - 1
        return self.steps[i] if i >= 0 else (self.steps[0] if self.steps else None)

    def clock_at(self, t: float) -> float | None:
        """The run's training seconds at unix time t (for marks known by time): between two
        steps the clock stands still first (the evaluation or checkpoint after a step), then
        runs up to the next step's; None when the steps carry no clock."""
        i = bisect_right(self.t, t) - 1
        if not self.t or self.clock[max(i, 0)] is None:
            return None
        if i < 0:
            return max(self.clock[0] - (self.t[0] - t), 0.0)
        if i + 1 == len(self.t) or self.clock[i + 1] is None:
            return self.clock[i] + (t - self.t[i])
        return max(self.clock[i], self.clock[i + 1] - (self.t[i + 1] - t))

    def add(self, rank: int, step: int, loss: float, t: float, tokens: float,
            clock: float | None = None) -> None:
        self.ranks.add(rank)
        if self.steps and step <= self.steps[-1]:
            return   # a rank reporting a step already closed (it lagged past the others): drop
        p = self.pending.setdefault(step, [0.0, 0, t, 0.0, clock])
        p[0] += loss
        p[1] += 1
        p[2] = max(p[2], t)
        p[3] += tokens
        if clock is not None:
            p[4] = clock if p[4] is None else max(p[4], clock)

    def settle(self, expected: int, flush: bool = False, max_pending: int = 64) -> None:
        """Close pending steps in order: up to the last one all `expected` ranks reported, and
        the oldest ones when more than max_pending wait (a rank far behind, or gone)."""
        if not self.pending:
            return
        keys = sorted(self.pending)
        if flush:
            upto = keys[-1]
        else:
            complete = [k for k in keys if self.pending[k][1] >= expected]
            upto = complete[-1] if complete else None
            if len(keys) > max_pending and (upto is None or upto < keys[-max_pending - 1]):
                upto = keys[-max_pending - 1]
            if upto is None:
                return
        for k in keys:
            if k > upto:
                break
            loss_sum, n, t, tok, clock = self.pending.pop(k)
            loss = loss_sum / n
            tokens = tok * max(expected, n) / n
            self.steps.append(k)
            self.loss.append(loss)
            self.t.append(t)
            self.clock.append(clock)
            self.tokens.append(tokens)
            z, spike = self.detector.update(loss)
            if spike:
                self.spikes.append(Spike(self.replica, k, t, tokens, loss, z))
