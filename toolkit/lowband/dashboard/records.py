"""The small records a RunModel keeps, and the tolerant readers of event fields behind them.

Transfer (a comm event), StepSpan (a step window), SyncMark (an outer sync) and Spike (a loss
spike) are what the figures draw; _num and _int read a number from an event field whatever odd
value it holds; _natural sorts names like "rank10" after "rank9".
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



def _natural(s: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s)]
