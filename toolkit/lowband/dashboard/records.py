"""The small records a RunModel keeps, and the tolerant readers of event fields behind them.

Transfer (a comm event), StepSpan (a step window), SyncMark (an outer sync), Spike (a loss
spike), Membership (a replica group's view of a new quorum, --elastic runs), MembershipMark
(a quorum change, every group's view merged), FailedCommit (an outer sync whose commit vote
failed, --elastic runs) and Restart (an attempt that continued the run) are what the figures
draw; _num and _int read a number from an event field whatever odd value it holds, _ints a list
of them; _natural sorts names like "rank10" after "rank9".
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple


class Transfer(NamedTuple):
    """One comm event: bytes that crossed a link between start and end (unix seconds)."""
    start: float
    end: float
    wire_bytes: float
    payload_bytes: float
    rank: int
    replica: int
    tag: str
    op: str
    codec: str
    direction: str | None
    begin: float | None = None     # when the bytes started to move, if the event says


class StepSpan(NamedTuple):
    rank: int
    replica: int
    start: float
    end: float
    step: int
    compute_s: float


class SyncMark(NamedTuple):
    t: float
    step: int | None
    label: str            # "frag0", "block3" or "all"
    anomaly: bool
    rank: int
    replica: int
    norm: float | None
    weight: float | None


class Spike(NamedTuple):
    replica: int
    step: int
    t: float
    tokens: float
    loss: float
    z: float


class Membership(NamedTuple):
    """One replica group's `membership` event of one quorum, its ranks' copies merged: t the
    earliest of them, heal_bytes summed over the ranks that received state (each receives its
    own), heal_s and wait_s the slowest rank's."""
    t: float
    step: int | None
    replica: int                  # the group that wrote it
    quorum_id: int | None
    size: int | None
    members: tuple[int, ...]      # the groups in the quorum
    joined: tuple[int, ...]       # vs. this group's previous quorum (all members at its start)
    left: tuple[int, ...]
    healed: bool                  # this group received a live peer's state in this quorum
    heal_bytes: float | None
    heal_s: float | None
    wait_s: float | None
    ranks: tuple[int, ...]        # the group's ranks that wrote it
    change: str                   # what changed, in words, from this group's view
    behind: str = ""              # healed in a quorum it did not (re)join: why it was behind
    lighthouse_restarted: bool = False  # its first quorum after the Lighthouse was restarted


class MembershipMark(NamedTuple):
    """A quorum change of the run: the Membership records of one quorum merged."""
    t: float
    step: int | None
    replica: int                  # a group that saw it (for its tokens and steps)
    quorum_id: int | None
    size: int | None
    members: tuple[int, ...]
    text: str                     # "group 1 left", "group 1 rejoined (healed 2.4 MB in 0.3 s)"
    healed: bool


class FailedCommit(NamedTuple):
    """An outer sync of one fragment whose commit vote failed in some group (`skip` events with
    what=commit, every reporting rank's merged): those groups skipped its outer update."""
    t: float                      # the earliest report
    step: int | None              # the step the sync started
    fragment: int | None
    label: str                    # "frag0", as sync marks name it
    replicas: tuple[int, ...]     # the groups that reported it
    reports: tuple[tuple[int, int, float], ...]   # (rank, group, t) of each reporting rank


class Restart(NamedTuple):
    """An attempt that continued the run after a crash or a Slurm requeue, or with --elastic a
    replica group's restart from its checkpoint: its ranks' `run` events (phase resume, or
    start over in place with events_kept) merged."""
    t: float                      # the earliest rank's run event
    step: int | None              # the step it resumed at (0: started over)
    attempt: int | None           # 1, 2, ...: the attempts before it
    superseded_to: int | None     # the last step the lost attempt reached (max over ranks)
    slurm_restart: int | None     # SLURM_RESTART_COUNT, when Slurm requeued the job
    replica: int                  # a replica that resumed (for its tokens and steps)
    reports: tuple[tuple[int, float], ...]   # (rank, t) of each rank's run event
    group: int | None = None      # --elastic: the replica group restarted alone (None: the run)
    healed_to: int | None = None  # that group's first quorum gave it a live peer's later step


def sync_label(event: dict) -> str:
    """The fragment or block a sync event is about, named like comm tags ("frag0", "block3")."""
    for key, prefix in (("fragment", "frag"), ("block", "block")):
        value = event.get(key)
        if value is None:
            continue
        if isinstance(value, str):
            return value
        return f"{prefix}{value}"
    return "all"


def _num(value, default=None):
    """A finite float from an event field, or default (readers must survive odd values)."""
    if isinstance(value, bool) or value is None:
        return default
    try:
        value = float(value)
    except (TypeError, ValueError):
        return default
    return value if math.isfinite(value) else default


def _int(value, default=None):
    value = _num(value)
    return default if value is None else int(value)


def _ints(value) -> tuple[int, ...]:
    """Sorted distinct integers from a list field (anything else: none)."""
    if not isinstance(value, (list, tuple)):
        return ()
    return tuple(sorted({i for i in (_int(v) for v in value) if i is not None}))


def _natural(s: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s)]
