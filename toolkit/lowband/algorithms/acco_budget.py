"""acco's budget in micro-batches (acco.py's docstring, "Budget"): the run ends when the
micro-batches computed over all ranks reach --steps x --grad-accum x world, and each group of
micro-batches gets caps, one per rank, that every rank computes alike from what all ranks know.
"""

from __future__ import annotations

from collections import deque


def apportion(total: int, weights: list[int]) -> list[int]:
    """`total` split over the ranks in proportion to `weights` (evenly where they are all 0):
    one for each rank first where the total allows, then the rest by largest remainder (the
    lower rank first among equals); integers only, so every rank computes the same split."""
    n = len(weights)
    if not any(weights):
        weights = [1] * n
    floor = 1 if total >= n else 0
    rest, whole = total - floor * n, sum(weights)
    caps = [floor + rest * x // whole for x in weights]
    by_remainder = sorted(range(n), key=lambda r: (-(rest * weights[r] % whole), r))
    for r in by_remainder[: total - sum(caps)]:
        caps[r] += 1
    return caps


def trim(counts: list[int], total: int) -> list[int]:
    """Per-rank counts cut to at most `total` in all, one at a time from the largest (the
    highest rank first among equals)."""
    counts = list(counts)
    for _ in range(sum(counts) - max(total, 0)):
        counts[max(range(len(counts)), key=lambda r: (counts[r], r))] -= 1
    return counts


class MicroBudget:
    """The run's budget in micro-batches over all ranks, and each group's caps (acco.py's
    docstring, "Budget"). Every rank holds the same one: it changes only with what all ranks
    know, the per-rank counts of landed rounds and the caps computed from them. Per step:
    first(), real_landed() (when the previous step's real round lands), second(),
    estimate_landed(), then top_up() on the last step. A round's counts are None where its
    caps were exact (fixed counts, step 0's first group, the last step's group 2)."""

    GROWTH = 2  # an adaptive group's caps: this many times the last such group's counts, + 1 a rank

    def __init__(self, total: int, world: int, fixed: list[tuple[int, int]] | None):
        self.total, self.world, self.fixed = total, world, fixed
        self.done = 0            # micro-batches in the real rounds landed
        self.last = [None, None]  # per rank: the last landed group 1 and group 2 (adaptive ones)
        self.first_counts = None  # the current step's group 1, once its estimate landed
        self.groups = deque()  # (caps, kind: 0/1 adaptive group 1/2, None exact) not landed yet

    def free(self) -> int:
        return (self.total - self.done - sum(self.first_counts or ())
                - sum(sum(caps) for caps, _ in self.groups))

    def spent(self) -> bool:
        return self.free() <= 0

    def _adaptive(self, kind: int, total: int) -> list[int]:
        """Caps of an adaptive group (kind 0: group 1, 1: group 2) summing to at most `total`
        and to GROWTH x the last such group + one a rank, split in proportion to that group's
        counts (so a group can grow fast, and its bound stays near what it takes)."""
        last = self.last[kind]
        if last is not None:
            total = min(total, self.GROWTH * sum(last) + self.world)
        caps = apportion(total, last or [0] * self.world)
        self.groups.append((caps, kind))
        return caps

    def _exact(self, caps: list[int]) -> list[int]:
        self.groups.append((caps, None))
        return caps

    def first(self, step: int) -> list[int]:
        """Caps of group 1."""
        if self.fixed is not None:
            return self._exact(trim([n1 for n1, _ in self.fixed], self.free()))
        if step == 0:  # the authors' first group: one micro-batch (no measure of speed)
            return self._exact([1] * self.world)
        return self._adaptive(0, (self.free() + 1) // 2)

    def real_landed(self, counts: list[int] | None) -> None:
        second, kind = self.groups.popleft()
        if counts is not None:
            second = [c - f for c, f in zip(counts, self.first_counts)]
        if kind is not None:
            self.last[kind] = second
        self.done += sum(self.first_counts) + sum(second)
        self.first_counts = None

    def second(self) -> tuple[list[int], bool]:
        """Caps of group 2, and whether this is the budget's last step (top_up() follows)."""
        free = self.free()
        if self.fixed is not None:
            return self._exact(trim([n2 for _, n2 in self.fixed], free)), False
        # the last step: at most 1.5 steps' micro-batches left, or no room for two more groups
        step = sum(self.last[0] or ()) + sum(self.last[1] or ())
        if self.total - self.done <= 1.5 * step or free < 3:
            return self._exact(apportion(free, self.last[1] or [0] * self.world)), True
        return self._adaptive(1, (free + 1) // 2), False

    def estimate_landed(self, counts: list[int] | None) -> None:
        first, kind = self.groups.popleft()
        self.first_counts = first if counts is None else counts
        if kind is not None:
            self.last[kind] = self.first_counts

    def top_up(self) -> list[int]:
        """The last step's group 2, once its estimate landed: its caps raised so that they
        take all that is left (every rank then computes exactly its cap)."""
        caps, _ = self.groups.pop()
        extra = apportion(self.free() - sum(caps), self.last[1] or [0] * self.world)
        return self._exact([c + e for c, e in zip(caps, extra)])

    def progress(self, grad_accum: int) -> float:
        """The step of the learning-rate schedule: ddp's steps so far, counted in micro-batches."""
        return self.done / (grad_accum * self.world)

    def state_dict(self) -> dict:
        return {"done": self.done, "last": list(self.last), "first_counts": self.first_counts,
                "groups": [list(g) for g in self.groups]}

    def load_state_dict(self, state: dict) -> None:
        self.done, self.first_counts = state["done"], state["first_counts"]
        self.last, self.groups = list(state["last"]), deque(tuple(g) for g in state["groups"])
