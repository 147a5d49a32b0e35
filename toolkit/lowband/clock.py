"""The run's training clock, and with --time-budget the ranks' one decision about it.

Training time is wall time in the trainer's loop without its pauses (evaluations, checkpoints),
plus what the attempts before a resume spent: the checkpoint keeps it (`Progress.wall_s`), and
summary.json's `wall_s` is the same measure.

--time-budget SECONDS: rank 0's clock decides for every rank. At a check (a step boundary every
rank reaches: the first before the first step, the next ones at the step rank 0 named) rank 0
broadcasts four numbers over a process group of its own: whether the run ends after these steps,
the step of the next check, the budget's elapsed fraction and its rate per step. Every rank
then reads the same elapsed fraction at every step (the learning rate follows it: schedule.py)
and stops after the same step, so no rank waits in a collective the others never reach. Rank 0
ends the run when less than half of a step's time is left, and otherwise names the next check
where its step time says the budget, or a twentieth of it, will be spent (at most twice the
last interval, from one step: the first steps' times are not yet a measure). So the run ends
within about half a step of its budget, after about twenty small broadcasts (not counted in the
link figures, as the start's barrier is not).

An algorithm that decides its syncs by time (aedit: its replicas run different step counts, so
they share no step boundary) keeps the budget itself, at its syncs: its clock is made without
one (`RunClock(None, ...)`), and it reads `seconds()`.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

CHECKS = 20  # a check at least every budget / CHECKS seconds


class RunClock:
    def __init__(self, budget: float | None, spent: float = 0.0,
                 device: torch.device | str = "cpu"):
        """budget: seconds, or None; spent: training seconds before this attempt (a resume).
        With a budget, every rank makes it at the same point (it makes a process group)."""
        self.budget, self.spent, self.device = budget, spent, device
        self.group = dist.new_group(list(range(dist.get_world_size()))) if budget else None
        self.next_check: int | None = None  # the step boundary of the next check (None: now)
        self.interval = 0
        self.anchor = (0, 0.0, 0.0)  # (step, elapsed fraction, fraction per step) of the last check
        self.last: tuple[int, float] | None = None  # rank 0: (step, seconds) at the last check
        self._t0, self._paused, self._pause_start = time.perf_counter(), 0.0, None

    def seconds(self) -> float:
        """This rank's training seconds so far (frozen during a pause)."""
        now = self._pause_start if self._pause_start is not None else time.perf_counter()
        return self.spent + now - self._t0 - self._paused

    @contextlib.contextmanager
    def paused(self):
        """Time that is not training (an evaluation, a checkpoint)."""
        self._pause_start = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - self._pause_start
            self._pause_start = None

    def fraction(self, step: int) -> float | None:
        """The budget's elapsed fraction at step `step` (0-based), the same on every rank: the
        last check's, moved on at its rate per step since (at most 1); None without a budget."""
        if not self.budget:
            return None
        at, elapsed, rate = self.anchor
        return min(elapsed + (step - at) * rate, 1.0)

    def ends_after(self, step: int) -> bool:
        """At a step boundary (`step` steps done) every rank reaches: whether the budget ends
        the run here. A collective at the checks; False without a budget."""
        if not self.budget or (self.next_check is not None and step < self.next_check):
            return False
        decision = torch.tensor(self._decide(step) if dist.get_rank() == 0 else [0.0] * 4,
                                dtype=torch.float64, device=self.device)
        dist.broadcast(decision, src=0, group=self.group)
        end, self.next_check, elapsed, rate = decision.tolist()
        self.next_check = int(self.next_check)
        self.interval = self.next_check - step
        self.anchor = (step, elapsed, rate)
        return bool(end)

    def _decide(self, step: int) -> list[float]:
        """Rank 0's decision at a check: [end, next check, elapsed fraction, rate per step]."""
        now = self.seconds()
        left = self.budget - now
        step_s = None
        if self.last is not None and step > self.last[0]:
            step_s = (now - self.last[1]) / (step - self.last[0])
        self.last = (step, now)
        if step_s is None:  # no measure yet: check again after one step
            return [float(left <= 0), step + 1.0, now / self.budget, 0.0]
        end = left <= 0.5 * step_s
        ahead = min(left, self.budget / CHECKS) / max(step_s, 1e-9)
        n = max(1, min(round(ahead), 2 * max(self.interval, 1)))
        return [float(end), float(step + n), now / self.budget, step_s / self.budget]
