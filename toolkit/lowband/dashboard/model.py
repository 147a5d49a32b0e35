"""What the dashboard and the report know about a run: events folded into small series.

Pure Python (and numpy for binning), no widgets and no plotting, so it is cheap to test and
shared by the live dashboard and the static report. A RunModel tails a run directory with
telemetry.EventTail (by byte offset, torn last lines left for later) and folds each new event
into running aggregates; nothing is ever re-read.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from bisect import bisect_right
from collections import deque
from pathlib import Path
from typing import NamedTuple

import numpy as np

from lowband import units
from lowband.telemetry import EventTail, RunDir


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
        self.loss: list[float] = []
        self.spikes: list[Spike] = []
        self.detector = detector
        self.pending: dict[int, list] = {}   # step -> [loss_sum, n, t_max, tokens_sum]
        self.ranks: set[int] = set()

    def tokens_at(self, step: int) -> float | None:
        i = bisect_right(self.steps, step) - 1
        return self.tokens[i] if i >= 0 else (self.tokens[0] if self.tokens else None)

    def step_at(self, t: float) -> int | None:
        """The step this replica had reached at time t (for marks known only by time)."""
        i = bisect_right(self.t, t) - 1
        return self.steps[i] if i >= 0 else (self.steps[0] if self.steps else None)

    def add(self, rank: int, step: int, loss: float, t: float, tokens: float) -> None:
        self.ranks.add(rank)
        if self.steps and step <= self.steps[-1]:
            return   # a rank reporting a step already closed (it lagged past the others): drop
        p = self.pending.setdefault(step, [0.0, 0, t, 0.0])
        p[0] += loss
        p[1] += 1
        p[2] = max(p[2], t)
        p[3] += tokens

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
            loss_sum, n, t, tok = self.pending.pop(k)
            loss = loss_sum / n
            tokens = tok * max(expected, n) / n
            self.steps.append(k)
            self.loss.append(loss)
            self.t.append(t)
            self.tokens.append(tokens)
            z, spike = self.detector.update(loss)
            if spike:
                self.spikes.append(Spike(self.replica, k, t, tokens, loss, z))


class RankState:
    __slots__ = ("replica", "step", "tokens", "t", "first_t", "n_steps", "step_s", "compute_s",
                 "loss")

    def __init__(self, replica: int):
        self.replica = replica
        self.step = -1
        self.tokens = 0.0
        self.t = self.first_t = None
        self.n_steps = 0
        self.step_s = self.compute_s = 0.0
        self.loss = None


def is_run_dir(path) -> bool:
    p = Path(path)
    return p.is_dir() and ((p / "config.json").is_file() or (p / "events").is_dir())


class RunModel:
    """Everything the dashboard draws about one run, updated incrementally by poll().

    source: a run directory (str or Path) or a launch handle with a `.run_dir` attribute (read
    at every poll until it names a directory, since a launcher may learn it late).
    """

    def __init__(self, source, *, spike_z: float = 5.0, spike_alpha: float = 0.05,
                 spike_warmup: int = 20, max_spans: int = 20000, stall_after: float | None = None):
        self.source = source
        self.spike_params = (spike_z, spike_alpha, spike_warmup)
        self.stall_after = stall_after
        self._run_dir: RunDir | None = None
        self._tail: EventTail | None = None
        self.config: dict = {}
        self.summary: dict | None = None
        self.events_seen = 0
        self.unknown_events = 0
        self.t0: float | None = None
        self.t_last: float | None = None
        self.ranks: dict[int, RankState] = {}
        self.replicas: dict[int, ReplicaSeries] = {}
        self._val: dict[int, list] = {}          # step -> [sum, n, t, replica]
        self.spike_events: list[Spike] = []
        self.syncs: list[SyncMark] = []
        self._anomalies: set = set()
        self.outer: list[Transfer] = []
        self.inner: deque[Transfer] = deque(maxlen=max_spans)
        self.steps: deque[StepSpan] = deque(maxlen=max_spans)
        self.outer_wire_bytes = 0.0
        self.outer_payload_bytes = 0.0
        self.inner_wire_bytes = 0.0
        self.peak_outer_payload = 0.0
        self.run_events: list[dict] = []
        self.max_step_s = 0.0
        self.files_mtime: float | None = None
        self.version = 0                          # bumps whenever something new was folded in
        self._cache: dict = {}

    # -- reading -------------------------------------------------------------------------------

    @property
    def run_dir(self) -> Path | None:
        if self._run_dir is None:
            path = getattr(self.source, "run_dir", self.source)
            if path is None:
                return None
            self._run_dir = RunDir(path)
            self._tail = EventTail(self._run_dir)
        return self._run_dir.root

    @property
    def name(self) -> str:
        name = self.config.get("name")
        if name:
            return str(name)
        root = self.run_dir
        return root.name if root is not None else "(pending run)"

    @property
    def finished(self) -> bool:
        return self.summary is not None

    @property
    def offsets(self) -> dict[Path, int]:
        """Bytes read so far from each event file (what the next poll starts from)."""
        return dict(self._tail.offsets) if self._tail else {}

    def poll(self) -> int:
        """Fold in the events appended since the last poll; returns how many were new."""
        if self.run_dir is None:
            return 0
        rd = self._run_dir
        if not self.config:
            self.config = rd.read_json(rd.config) or {}
            if self.config:
                self.version += 1
        # Look for the summary before reading events: once it exists the files are complete,
        # so the events read below are all of them.
        summary = rd.read_json(rd.summary) if self.summary is None else None
        events = self._tail.poll()
        for event in events:
            self._ingest(event)
        self.events_seen += len(events)
        try:
            mtimes = [p.stat().st_mtime for p in rd.events.glob("rank*.jsonl")]
        except OSError:
            mtimes = []
        if mtimes:
            self.files_mtime = max(mtimes)
        self._settle(flush=summary is not None)
        if summary is not None:
            self.summary = summary
        if events or summary is not None:
            self.version += 1
        return len(events)

    def load(self) -> "RunModel":
        """Read everything there is now and close pending steps (for reports and finished runs)."""
        self.poll()
        self._settle(flush=True)
        self.version += 1
        return self

    # -- folding events in ---------------------------------------------------------------------

    def _ingest(self, e: dict) -> None:
        t = _num(e.get("t"))
        rank = _int(e.get("rank"))
        if t is None or rank is None:
            return
        replica = _int(e.get("replica"), 0)
        kind = e.get("kind")
        handler = getattr(self, f"_on_{kind}", None) if isinstance(kind, str) else None
        if handler is None:
            self.unknown_events += 1
            return
        self.t_last = t if self.t_last is None else max(self.t_last, t)
        handler(e, t, rank, replica)

    def _see_time(self, t: float) -> None:
        self.t0 = t if self.t0 is None else min(self.t0, t)

    def _replica(self, replica: int) -> ReplicaSeries:
        rs = self.replicas.get(replica)
        if rs is None:
            z, alpha, warmup = self.spike_params
            rs = self.replicas[replica] = ReplicaSeries(replica, SpikeDetector(z, alpha, warmup))
        return rs

    def _on_step(self, e, t, rank, replica):
        step, loss = _int(e.get("step")), _num(e.get("loss"))
        if step is None:
            return
        step_s = _num(e.get("step_s"), 0.0)
        compute_s = _num(e.get("compute_s"), 0.0)
        tokens = _num(e.get("tokens"), 0.0)
        self._see_time(t - step_s)
        rs = self.ranks.get(rank)
        if rs is None:
            rs = self.ranks[rank] = RankState(replica)
        if rs.first_t is None:
            rs.first_t = t - step_s
        rs.step, rs.tokens, rs.t, rs.loss = max(rs.step, step), max(rs.tokens, tokens), t, loss
        rs.n_steps += 1
        rs.step_s += step_s
        rs.compute_s += compute_s
        self.max_step_s = max(self.max_step_s, step_s)
        self.steps.append(StepSpan(rank, replica, t - step_s, t, step, compute_s))
        if loss is not None:
            self._replica(replica).add(rank, step, loss, t, tokens)

    def _on_comm(self, e, t, rank, replica):
        start, end = _num(e.get("start"), t), _num(e.get("end"), t)
        if end < start:
            start, end = end, start
        self._see_time(start)
        wire = _num(e.get("wire_bytes"), 0.0)
        payload = _num(e.get("payload_bytes"), wire)
        direction = e.get("direction")
        tr = Transfer(start, end, wire, payload, rank, replica, str(e.get("tag", "")),
                      str(e.get("op", "")), str(e.get("codec", "")),
                      str(direction) if direction is not None else None, _num(e.get("begin")))
        if e.get("group") == "outer":
            self.outer.append(tr)
            self.outer_wire_bytes += wire
            self.outer_payload_bytes += payload
            self.peak_outer_payload = max(self.peak_outer_payload, payload)
        else:
            self.inner.append(tr)
            self.inner_wire_bytes += wire

    def _on_sync(self, e, t, rank, replica):
        self._see_time(t)
        label = sync_label(e)
        step = _int(e.get("step"))
        anomaly = bool(e.get("anomaly", False))
        self.syncs.append(SyncMark(t, step, label, anomaly, rank, replica,
                                   _num(e.get("pseudo_grad_norm")), _num(e.get("weight"))))
        if anomaly:
            self._anomalies.add((replica, step, label))

    def _on_eval(self, e, t, rank, replica):
        step, val = _int(e.get("step")), _num(e.get("val_loss"))
        if step is None or val is None:
            return
        self._see_time(t)
        v = self._val.setdefault(step, [0.0, 0, t, replica])
        v[0] += val
        v[1] += 1
        v[2] = max(v[2], t)

    def _on_spike(self, e, t, rank, replica):
        step, loss = _int(e.get("step")), _num(e.get("loss"))
        if step is None or loss is None:
            return
        self.spike_events.append(Spike(replica, step, t, float("nan"), loss,
                                       _num(e.get("z"), float("nan"))))

    def _on_run(self, e, t, rank, replica):
        self._see_time(t)
        self.run_events.append(e)

    def _settle(self, flush: bool = False) -> None:
        shards = _int(self.config.get("shards"))
        for rs in self.replicas.values():
            expected = shards if shards and shards > 0 else len(rs.ranks)
            rs.settle(expected, flush)

    # -- derived views -------------------------------------------------------------------------

    @property
    def n_replicas(self) -> int:
        r = _int(self.config.get("replicas"))
        return r if r and r > 0 else max(1, len(self.replicas))

    def run_tokens(self, replica_tokens: float) -> float:
        """Tokens the whole run has seen when a replica has seen replica_tokens (replicas are
        assumed to keep pace, exact for the synchronous algorithms)."""
        return replica_tokens * self.n_replicas

    def val_series(self) -> tuple[list[int], list[float], list[float], list[float]]:
        """(steps, val_loss, t, run tokens): the mean over ranks that evaluated at each step."""
        steps, vals, ts, toks = [], [], [], []
        for step in sorted(self._val):
            s, n, t, replica = self._val[step]
            rs = self.replicas.get(replica)
            tok = rs.tokens_at(step) if rs else None
            steps.append(step)
            vals.append(s / n)
            ts.append(t)
            toks.append(self.run_tokens(tok) if tok is not None else float("nan"))
        return steps, vals, ts, toks

    def detected_spikes(self) -> list[Spike]:
        return sorted((s for rs in self.replicas.values() for s in rs.spikes),
                      key=lambda s: s.t)

    def sync_marks(self) -> list[SyncMark]:
        if self._cache.get("version") != self.version:
            self._cache = {"version": self.version}
        if "marks" not in self._cache:
            self._cache["marks"] = self._sync_marks()
        return self._cache["marks"]

    def _sync_marks(self) -> list[SyncMark]:
        """Outer syncs, one mark per (step, fragment/block): from sync events when the run has
        them, else from outer comm events merged where they overlap in time. Runs whose every
        step talks over the outer group (ddp, acco) get no marks from comm events."""
        if self.syncs:
            seen: dict = {}
            for m in self.syncs:
                key = (m.step, m.label)
                prev = seen.get(key)
                if prev is None or m.t > prev.t or (m.anomaly and not prev.anomaly):
                    seen[key] = m._replace(t=max(m.t, prev.t) if prev else m.t,
                                           anomaly=m.anomaly or (prev.anomaly if prev else False))
            return sorted(seen.values(), key=lambda m: m.t)
        if str(self.config.get("algo", "")).lower() in ("ddp", "acco") or not self.outer:
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

    @property
    def anomalies(self) -> int:
        return len(self._anomalies)

    def current_step(self) -> int | None:
        steps = [rs.step for rs in self.ranks.values() if rs.step >= 0]
        return max(steps) if steps else None

    def status(self, now: float | None = None) -> str:
        """waiting (no events yet), running, stalled (event files untouched for a while),
        ended (a run end event but no summary yet) or finished (summary.json exists)."""
        if self.summary is not None:
            return "finished"
        if not self.events_seen:
            return "waiting"
        if any(e.get("phase") == "end" for e in self.run_events):
            return "ended"
        now = time.time() if now is None else now
        stall_after = self.stall_after or max(60.0, 5 * self.max_step_s)
        if self.files_mtime is not None and now - self.files_mtime > stall_after:
            return "stalled"
        return "running"

    def bandwidth(self, max_bins: int = 300, by: str = "link") -> dict:
        """Outer-link traffic binned over time (seconds since t0).

        Each rank's outgoing outer bytes share one link (the comm layer's emulated link is per
        rank), and each comm event's wire_bytes are what that rank sent. by="link": one series
        per rank link, split by direction when comm events carry a `direction`; by="total": one
        series, the sum over links. Each transfer's bytes are spread evenly over its
        transmission window (see transmission_windows).

        Returns {"edges": bin edges (s), "width": s, "series": {name: bytes/s per bin},
        "links": links that carried bytes, "peak": highest binned rate of one series,
        "mean": mean rate of the busiest link over the run, "capacity": bytes/s or None}.
        """
        if self._cache.get("version") != self.version:
            self._cache = {"version": self.version}
        key = (max_bins, by)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        out = {"edges": np.zeros(0), "width": 0.0, "series": {}, "links": 0, "peak": 0.0,
               "mean": 0.0, "capacity": self.capacity()}
        if self.outer and self.t0 is not None:
            self._bin_outer(out, max_bins, by)
        self._cache[key] = out
        return out

    def _bin_outer(self, out: dict, max_bins: int, by: str) -> None:
        starts, ends = self.transmission_windows()
        starts, ends = starts - self.t0, ends - self.t0
        nbytes = np.fromiter((x.wire_bytes for x in self.outer), float, len(self.outer))
        t_end = max(float(ends.max()), (self.t_last or self.t0) - self.t0)
        t_start = min(0.0, float(starts.min()))
        width = nice_width((t_end - t_start) / max_bins)
        nbins = min(max(1, int(math.ceil((t_end - t_start) / width - 1e-9))), max_bins + 1)
        edges = t_start + width * np.arange(nbins + 1)
        if edges[-1] < t_end:   # float round-off: make sure the last transfer fits
            edges[-1] = t_end
        if by == "total":
            keys = ["all links"] * len(self.outer)
        else:
            keys = [f"rank {x.rank} {x.direction}" if x.direction else f"rank {x.rank}"
                    for x in self.outer]
        keys_arr = np.array(keys)
        series = {}
        for k in sorted(set(keys), key=_natural):
            m = keys_arr == k
            series[k] = bin_transfers(starts[m], ends[m], nbytes[m], edges) / np.diff(edges)
        per_link: dict[int, float] = {}
        for x in self.outer:
            per_link[x.rank] = per_link.get(x.rank, 0.0) + x.wire_bytes
        out.update(edges=edges, width=width, series=series, links=len(per_link),
                   peak=max(float(v.max()) for v in series.values()),
                   mean=max(per_link.values()) / max(t_end - t_start, 1e-9))

    def transmission_windows(self) -> tuple[np.ndarray, np.ndarray]:
        """When each outer transfer's bytes were on the wire (unix s), in self.outer's order.

        A comm event's [start, end] runs from the request to completion, so with an emulated
        link (config link_bandwidth) it includes waiting in the link's FIFO queue behind earlier
        transfers and the link latency. There, a rank's transfers are replayed in order of
        start: one begins when it starts or when the previous one left the link, whichever is
        later, and ends at `end` less the latency. An event's own `begin` field, when present,
        is used as is. Without an emulated link the windows are [start, end].
        """
        n = len(self.outer)
        starts = np.fromiter((x.start for x in self.outer), float, n)
        ends = np.fromiter((x.end for x in self.outer), float, n)
        if self.capacity() is None and not any(x.begin is not None for x in self.outer):
            return starts, ends
        latency = self.link_latency()
        free: dict[int, float] = {}
        for i in sorted(range(n), key=lambda i: (self.outer[i].start, self.outer[i].end)):
            x = self.outer[i]
            begin = x.begin if x.begin is not None else max(x.start, free.get(x.rank, x.start))
            begin = min(max(begin, x.start), x.end)
            done = x.end - latency if x.end - latency > begin else x.end
            starts[i], ends[i] = begin, done
            free[x.rank] = max(free.get(x.rank, done), done)
        return starts, ends

    def capacity(self) -> float | None:
        """The outer link's capacity in bytes/s, from config link_bandwidth (bits/s, either a
        number or text like "100Mbit"); None when the run has no emulated link."""
        bits = parse_bits(self.config.get("link_bandwidth"))
        return bits / 8.0 if bits else None

    def link_latency(self) -> float:
        return parse_seconds(self.config.get("link_latency")) or 0.0

    def stats(self, now: float | None = None) -> dict:
        """Headline numbers: from summary.json once it exists, live estimates before that."""
        s = self.summary or {}
        tokens = _num(s.get("tokens"), sum(r.tokens for r in self.ranks.values()))
        elapsed = (self.t_last - self.t0) if self.t0 is not None and self.t_last else 0.0
        wall = _num(s.get("wall_s"), elapsed)
        world = len(self.ranks) or 1
        compute = sum(r.compute_s for r in self.ranks.values())
        outer = _num(s.get("outer_wire_bytes"), self.outer_wire_bytes)
        bw = self.bandwidth(max_bins=200) if self.outer else None
        last_losses = [rs.loss[-1] for rs in self.replicas.values() if rs.loss]
        val_steps, vals, _, _ = self.val_series()
        return {
            "name": self.name,
            "algorithm": s.get("algorithm", self.config.get("algo")),
            "status": self.status(now),
            "step": self.current_step(),
            "steps": _int(self.config.get("steps")),
            "tokens": tokens,
            "wall_s": wall,
            "tokens_per_s": _num(s.get("tokens_per_s"), tokens / wall if wall > 0 else None),
            "compute_utilization": _num(s.get("compute_utilization"),
                                        compute / (world * wall) if wall > 0 else None),
            "outer_wire_bytes": outer,
            "inner_wire_bytes": _num(s.get("inner_wire_bytes"), self.inner_wire_bytes),
            "peak_outer_payload_bytes": _num(s.get("peak_outer_payload_bytes"),
                                             self.peak_outer_payload),
            "bytes_per_token": outer / tokens if tokens else None,
            "peak_outer_bytes_per_s": bw["peak"] if bw else None,
            "mean_outer_bytes_per_s": bw["mean"] if bw else None,
            "link_capacity_bytes_per_s": self.capacity(),
            "anomalies": self.anomalies,
            "spikes": len({(s.step) for s in self.detected_spikes()}
                          | {(s.step) for s in self.spike_events}),
            "loss": _num(s.get("final_loss"),
                         statistics.fmean(last_losses) if last_losses else None),
            "val_loss": _num(s.get("final_val_loss"), vals[-1] if vals else None),
        }


def _natural(s: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s)]


def _optional(parse, value) -> float | None:
    """A positive finite quantity, or None when unset or unreadable (the trainer's config
    check is the one that refuses bad input)."""
    if value is None or value == "":
        return None
    try:
        v = parse(value)
    except ValueError:
        return None
    return v if 0 < v < math.inf else None


def parse_bits(value) -> float | None:
    """Bits per second from a config value: 1e8, "100Mbit", "1Gbit/s", "10mbps"."""
    return _optional(units.parse_bandwidth, value)


def parse_seconds(value) -> float | None:
    """Seconds from 0.02, "20ms", "150us"."""
    return _optional(units.parse_duration, value)


def nice_width(w: float) -> float:
    """The smallest 1-2-5 multiple of a power of ten that is at least w (and at least 1 ms)."""
    w = max(w, 1e-3)
    exp = math.floor(math.log10(w))
    for m in (1, 2, 5, 10):
        if m * 10 ** exp >= w * (1 - 1e-9):
            return m * 10 ** exp
    return 10 ** (exp + 1)


def bin_transfers(starts, ends, nbytes, edges) -> np.ndarray:
    """Bytes per bin when each transfer's bytes are spread evenly over [start, end].

    Exact and O((N + K) log N): the bytes carried up to time x are
    F(x) = sum_i r_i * (clip(x, s_i, e_i) - s_i), r_i = b_i / (e_i - s_i), evaluated at every
    edge with prefix sums over the sorted starts and ends. Zero-length transfers land whole in
    the bin holding their start. Bytes outside [edges[0], edges[-1]] are dropped.
    """
    starts, ends = np.asarray(starts, float), np.asarray(ends, float)
    nbytes, edges = np.asarray(nbytes, float), np.asarray(edges, float)
    out = np.zeros(max(len(edges) - 1, 0))
    if not len(starts) or not len(out):
        return out
    dur = ends - starts
    point = dur <= 0
    if point.any():
        idx = np.searchsorted(edges, starts[point], side="right") - 1
        ok = (idx >= 0) & (idx < len(out))
        ok |= starts[point] == edges[-1]
        idx = np.clip(idx, 0, len(out) - 1)
        np.add.at(out, idx[ok], nbytes[point][ok])
    span = ~point
    if span.any():
        s, e, b = starts[span], ends[span], nbytes[span]
        r = b / (e - s)

        def cum(x_sorted, rates):
            order = np.argsort(x_sorted)
            xs, rs = x_sorted[order], rates[order]
            return xs, np.concatenate([[0.0], np.cumsum(rs)]), \
                np.concatenate([[0.0], np.cumsum(rs * xs)])

        xs_s, r_s, rx_s = cum(s, r)
        xs_e, r_e, rx_e = cum(e, r)
        i_s = np.searchsorted(xs_s, edges, side="left")
        i_e = np.searchsorted(xs_e, edges, side="left")
        f = (edges * r_s[i_s] - rx_s[i_s]) - (edges * r_e[i_e] - rx_e[i_e])
        out += np.diff(f)
    return out
