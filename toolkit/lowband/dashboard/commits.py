"""Failed commit votes of an --elastic run (docs/elastic.md): outer syncs whose commit vote failed
in some replica group (a peer died mid-exchange, or the quorum was below --min-replicas). Each
group votes for itself (torchft's vote joins a group's ranks, not the groups), so the groups
whose vote failed skipped the outer update of that fragment while the others may have applied
it; a group that skipped one is behind and takes a live peer's state at a later quorum. Every
rank whose vote failed writes a `skip` event with what=commit and the step the sync started;
one FailedCommit per (step, fragment) merges them.

FailedCommits is a part of RunModel (it folds in skip events and reads the model's _cached); the
records are drawn on the loss figure and the sync timeline and listed in the report. Skips of the
other kinds (what=gradient or pseudo-gradient: a non-finite update) are not drawn.
"""

from __future__ import annotations

from .membership import groups_text
from .records import FailedCommit, _int, sync_label


def commit_text(rec: FailedCommit) -> str:
    """What every view says of a failed commit: "commit vote failed in group 2: outer update of
    fragment 0 skipped there (step 40)"."""
    what = "outer update" + ("" if rec.fragment is None else f" of fragment {rec.fragment}")
    step = "?" if rec.step is None else rec.step
    if not rec.replicas:
        return f"commit vote failed: {what} skipped (step {step})"
    return f"commit vote failed in {groups_text(rec.replicas)}: {what} skipped there (step {step})"


class FailedCommits:
    """RunModel's failed commit votes (a mixin: keeps _commits, calls _see_time and _cached)."""

    def _fold_skip(self, e: dict, t: float, rank: int, replica: int) -> None:
        if e.get("what") != "commit":
            return
        self._see_time(t)
        step, label = _int(e.get("step")), sync_label(e)
        fragment, ranks = self._commits.setdefault((step, label), (_int(e.get("fragment")), {}))
        prev = ranks.get(rank)
        ranks[rank] = (replica, t if prev is None else min(prev[1], t))

    def failed_commits(self) -> list[FailedCommit]:
        """One record per outer sync whose commit vote failed, in time order (empty without
        --elastic or without a failed vote)."""
        if not self._commits:
            return []
        return self._cached("failed_commits", self._failed_commits)

    def _failed_commits(self) -> list[FailedCommit]:
        out = []
        for (step, label), (fragment, ranks) in self._commits.items():
            reports = tuple(sorted((r, q, t) for r, (q, t) in ranks.items()))
            out.append(FailedCommit(min(t for _, _, t in reports), step, fragment, label,
                                    tuple(sorted({q for _, q, _ in reports})), reports))
        return sorted(out, key=lambda c: (c.t, c.label))
