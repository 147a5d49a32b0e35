"""What the dashboard and the report know about a run: events folded into small series.

Pure Python (and numpy for binning), no widgets and no plotting, so it is cheap to test and
shared by the live dashboard and the static report. A RunModel tails a run directory with
telemetry.EventTail (by byte offset, torn last lines left for later) and folds each new event
into running aggregates; nothing is re-read, unless a continued run (a resume after a crash or
a requeue) makes events already folded in those of a lost attempt: then the model starts over.

This module holds RunModel itself: reading the run directory, folding events in, and the
headline numbers. Its parts live beside it: records.py (the records it keeps and the event field
readers), losses.py (per-replica loss curves, spike detection), syncs.py (outer-sync marks),
membership.py (replica groups joining and leaving an --elastic run's quorum), commits.py (its
failed commit votes), restarts.py (attempts that continued the run), replicas.py (each
replica's work: steps, tokens, compute utilization, waits), bandwidth.py
(outer-link traffic binned over time) and axes.py (where a point lies on the loss figure's x
axes). Their public names import from here too.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from pathlib import Path

from lowband.telemetry import KINDS, EventTail, RunDir

from .axes import LossAxes
from .bandwidth import OuterTraffic, bin_transfers, nice_width, parse_bits, parse_seconds
from .commits import FailedCommits
from .losses import ReplicaSeries, SpikeDetector, detect_spikes
from .membership import MembershipChanges
from .records import (FailedCommit, Membership, MembershipMark, Restart, Spike, StepSpan,
                      SyncMark, Transfer, _int, _num, sync_label)
from .replicas import ReplicaWork, ReplicaWorks
from .restarts import Restarts
from .syncs import SyncMarks

__all__ = ["FailedCommit", "Membership", "MembershipMark", "RankState", "ReplicaSeries",
           "ReplicaWork", "Restart", "RunModel", "Spike", "SpikeDetector", "StepSpan",
           "SyncMark", "Transfer", "bin_transfers", "detect_spikes", "is_run_dir", "nice_width",
           "parse_bits", "parse_seconds", "sync_label"]

# the event kinds read: the telemetry's, and those the trainer writes beyond them
READ_KINDS = KINDS


class RankState:
    __slots__ = ("replica", "step", "tokens", "t", "first_t", "n_steps", "step_s", "compute_s",
                 "loss", "elapsed_s")

    def __init__(self, replica: int):
        self.replica = replica
        self.step = -1
        self.tokens = 0.0
        self.t = self.first_t = None
        self.n_steps = 0
        self.step_s = self.compute_s = 0.0
        self.loss = None
        self.elapsed_s = None      # its training seconds at its latest step (its clock)


def is_run_dir(path) -> bool:
    p = Path(path)
    return p.is_dir() and ((p / "config.json").is_file() or (p / "events").is_dir())


class RunModel(SyncMarks, OuterTraffic, MembershipChanges, FailedCommits, Restarts, LossAxes,
               ReplicaWorks):
    """Everything the dashboard draws about one run, updated incrementally by poll().

    source: a run directory (str or Path) or a launch handle with a `.run_dir` attribute (read
    at every poll until it names a directory, since a launcher may learn it late).
    """

    def __init__(self, source, *, spike_z: float = 5.0, spike_alpha: float = 0.05,
                 spike_warmup: int = 20, max_spans: int = 20000, stall_after: float | None = None):
        self.source = source
        self.spike_params = (spike_z, spike_alpha, spike_warmup)
        self.stall_after = stall_after
        self.max_spans = max_spans
        self._run_dir: RunDir | None = None
        self._tail: EventTail | None = None
        self.config: dict = {}
        self.summary: dict | None = None
        self.version = 0                          # bumps whenever something new was folded in
        self._reset()

    def _reset(self) -> None:
        """Forget every event folded in: a new model but for its source, config and summary."""
        self.events_seen = 0
        self.unknown_events = 0
        self.t0: float | None = None
        self.t_last: float | None = None
        self.ranks: dict[int, RankState] = {}
        self.replicas: dict[int, ReplicaSeries] = {}
        # step -> [sum, n, t, replica, {elapsed_s, tokens, outer_bytes}: what reaching it took]
        self._val: dict[int, list] = {}
        self.spike_events: list[Spike] = []
        self.syncs: list[SyncMark] = []
        self._anomalies: set = set()
        self.outer: list[Transfer] = []
        self.inner: deque[Transfer] = deque(maxlen=self.max_spans)
        self.steps: deque[StepSpan] = deque(maxlen=self.max_spans)
        self.outer_wire_bytes = 0.0
        self.outer_payload_bytes = 0.0
        self.inner_wire_bytes = 0.0
        self.peak_outer_payload = 0.0
        self.run_events: list[dict] = []
        self._members: dict = {}                 # (replica, quorum) -> what its ranks said
        self._quorums: list[dict] = []           # every quorum each group took (its first rank)
        self._commits: dict = {}                 # (step, fragment) -> failed votes' reports
        self._restarts: dict = {}                # (attempt, step, group) -> its ranks' words
        self._pace: dict = {}                    # replica -> (run step, its steps a period)
        self._missed: dict = {}                  # replica -> run steps of syncs it missed
        self.max_step_s = 0.0
        self.files_mtime: float | None = None
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
        events = self._tail.poll(READ_KINDS)
        if self._tail.rewound:  # some events folded in belong to a lost attempt: read afresh
            self._reset()
            self._tail = EventTail(rd)
            events = self._tail.poll(READ_KINDS)
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
        elapsed = _num(e.get("elapsed_s"))
        if elapsed is not None:
            rs.elapsed_s = elapsed if rs.elapsed_s is None else max(rs.elapsed_s, elapsed)
        self.max_step_s = max(self.max_step_s, step_s)
        self.steps.append(StepSpan(rank, replica, t - step_s, t, step, compute_s))
        if loss is not None:
            self._replica(replica).add(rank, step, loss, t, tokens, elapsed)

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
        self._fold_pace(e, replica)

    def _on_eval(self, e, t, rank, replica):
        step, val = _int(e.get("step")), _num(e.get("val_loss"))
        if step is None or val is None:
            return
        self._see_time(t)
        v = self._val.setdefault(step, [0.0, 0, t, replica, {}])
        v[0] += val
        v[1] += 1
        v[2] = max(v[2], t)
        for key in ("elapsed_s", "tokens", "outer_bytes"):  # the same on every rank
            if _num(e.get(key)) is not None:
                v[4][key] = _num(e.get(key))

    def _on_spike(self, e, t, rank, replica):
        step, loss = _int(e.get("step")), _num(e.get("loss"))
        if step is None or loss is None:
            return
        self.spike_events.append(Spike(replica, step, t, float("nan"), loss,
                                       _num(e.get("z"), float("nan"))))

    def _on_membership(self, e, t, rank, replica):
        self._see_time(t)
        self._fold_membership(e, t, rank, replica)

    def _on_quorum(self, e, t, rank, replica):
        self._quorums.append(e)

    def _on_skip(self, e, t, rank, replica):
        self._fold_skip(e, t, rank, replica)

    def _on_run(self, e, t, rank, replica):
        self._see_time(t)
        self.run_events.append(e)
        self._fold_run(e, t, rank, replica)

    def _settle(self, flush: bool = False) -> None:
        shards = _int(self.config.get("shards"))
        for rs in self.replicas.values():
            expected = shards if shards and shards > 0 else len(rs.ranks)
            rs.settle(expected, flush)

    # -- derived views -------------------------------------------------------------------------

    def _cached(self, key, make):
        """make(), kept until something new is folded in (the version changes)."""
        if self._cache.get("version") != self.version:
            self._cache = {"version": self.version}
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    @property
    def n_replicas(self) -> int:
        r = _int(self.config.get("replicas"))
        return r if r and r > 0 else max(1, len(self.replicas))

    def run_tokens(self, replica_tokens: float) -> float:
        """Tokens the whole run has seen when a replica has seen replica_tokens (replicas are
        assumed to keep pace, exact for the synchronous algorithms)."""
        return replica_tokens * self.n_replicas

    def val_series(self) -> tuple[list[int], list[float], list[float], list[float]]:
        """(steps, val_loss, t, run tokens): the mean over ranks that evaluated at each step;
        the tokens the eval events say, else estimated (run_tokens)."""
        steps, vals, ts, toks = [], [], [], []
        for step in sorted(self._val):
            s, n, t, replica, took = self._val[step]
            rs = self.replicas.get(replica)
            tok = rs.tokens_at(step) if rs else None
            steps.append(step)
            vals.append(s / n)
            ts.append(t)
            toks.append(took.get("tokens", self.run_tokens(tok) if tok is not None else math.nan))
        return steps, vals, ts, toks

    def detected_spikes(self) -> list[Spike]:
        return sorted((s for rs in self.replicas.values() for s in rs.spikes),
                      key=lambda s: s.t)

    @property
    def anomalies(self) -> int:
        return len(self._anomalies)

    def current_step(self) -> int | None:
        steps = [rs.step for rs in self.ranks.values() if rs.step >= 0]
        return max(steps) if steps else None

    def status(self, now: float | None = None) -> str:
        """waiting (no events yet), running, stalled (event files untouched for a while),
        ended (every rank's latest run event is its end, but no summary yet) or finished
        (summary.json exists)."""
        if self.summary is not None:
            return "finished"
        if not self.events_seen:
            return "waiting"
        latest = {e.get("rank"): e.get("phase") for e in self.run_events}  # in each file's order
        if latest and all(phase == "end" for phase in latest.values()):
            return "ended"
        now = time.time() if now is None else now
        stall_after = self.stall_after or max(60.0, 5 * self.max_step_s)
        if self.files_mtime is not None and now - self.files_mtime > stall_after:
            return "stalled"
        return "running"

    def stats(self, now: float | None = None) -> dict:
        """Headline numbers: from summary.json once it exists, live estimates before that."""
        s = self.summary or {}
        tokens = _num(s.get("tokens"), sum(r.tokens for r in self.ranks.values()))
        elapsed = (self.t_last - self.t0) if self.t0 is not None and self.t_last else 0.0
        wall = _num(s.get("wall_s"), elapsed)
        world = len(self.ranks) or 1
        compute = sum(r.compute_s for r in self.ranks.values())
        outer = _num(s.get("outer_wire_bytes"), self.outer_wire_bytes)
        bw = self.bandwidth() if self.outer else None  # the figure's bins: the figure's peak
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

