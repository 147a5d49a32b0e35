"""Outer-sync marks of a run: from its sync events, or from its outer transfers when it has none.

SyncMarks is a part of RunModel (it reads the model's syncs, outer transfers, replicas and
config); the marks are drawn on the loss figure and the sync timeline.
"""

from __future__ import annotations

from lowband.algorithms import ALGORITHMS
from lowband.algorithms.base import EVERY_STEP

from .records import SyncMark


def every_step(algo) -> bool:
    """Whether the algorithm named `algo` sends over the outer link at every step (its kind in
    the registry, lowband.algorithms); a name the registry does not know counts as periodic."""
    cls = ALGORITHMS.get(str(algo or "").lower())
    return cls is not None and cls.kind == EVERY_STEP


class SyncMarks:
    """RunModel's sync marks (a mixin: reads syncs, outer, replicas, config; calls _cached)."""

    def sync_marks(self) -> list[SyncMark]:
        return self._cached("marks", self._sync_marks)

    def _sync_marks(self) -> list[SyncMark]:
        """Outer syncs, one mark per (step, fragment/block): from sync events when the run has
        them, else from outer comm events merged where they overlap in time. Runs whose every
        step talks over the outer group (every_step) get no marks from comm events."""
        if self.syncs:
            seen: dict = {}
            for m in self.syncs:
                key = (m.step, m.label)
                prev = seen.get(key)
                if prev is None or m.t > prev.t or (m.anomaly and not prev.anomaly):
                    seen[key] = m._replace(t=max(m.t, prev.t) if prev else m.t,
                                           anomaly=m.anomaly or (prev.anomaly if prev else False))
            return sorted(seen.values(), key=lambda m: m.t)
        if every_step(self.config.get("algo")) or not self.outer:
            return []
        marks: list[SyncMark] = []
        cur_end, cur_tags, cur_rank, cur_replica = None, set(), 0, 0
        for tr in sorted(self.outer, key=lambda x: x.start):
            if cur_end is not None and tr.start <= cur_end:
                cur_end = max(cur_end, tr.end)
                cur_tags.add(tr.tag)
                continue
            if cur_end is not None:
                marks.append(self._comm_mark(cur_end, cur_tags, cur_rank, cur_replica))
            cur_end, cur_tags, cur_rank, cur_replica = tr.end, {tr.tag}, tr.rank, tr.replica
        if cur_end is not None:
            marks.append(self._comm_mark(cur_end, cur_tags, cur_rank, cur_replica))
        return marks

    def _comm_mark(self, t, tags, rank, replica) -> SyncMark:
        rs = self.replicas.get(replica)
        step = rs.step_at(t) if rs else None
        label = next(iter(tags)) if len(tags) == 1 else "all"
        return SyncMark(t, step, label or "all", False, rank, replica, None, None)
