"""The run directory and its events: the contract between trainer, dashboard and report.

runs/<name>/config.json            the validated config
runs/<name>/events/rank<r>.jsonl   append-only, one JSON object a line
runs/<name>/summary.json           written at the end: totals and final metrics
runs/<name>/logs/rank<r>.log       what a worker printed (ranks other than 0, local launches)
runs/<name>/model.pt, outer.pt     final weights; checkpoints/ with --checkpoint-every

A directory holds a run once it has a config, a summary, weights, an event file or a
checkpoint; a new run starts only in one that holds none (RunDir.claim), so two runs never
share event files. Its result files (config.json, summary.json, model.pt, outer.pt, report.html)
are written whole or not at all (atomic_path): a full disk or a crash leaves no truncated one.

Every event carries v (schema version), t (unix seconds), rank, replica and kind. Kinds:
  step  step, loss, lr, tokens (cumulative, this rank), step_s, compute_s, elapsed_s
  comm  op, group (outer/inner), tag, payload_bytes, wire_bytes, codec, start, end
  sync  step, fragment/block, pseudo_grad_norm, weight, anomaly, outer_lr
  eval  step, val_loss; elapsed_s (training seconds), tokens and outer_bytes (run-wide so far)
  spike step, loss, z
  run   phase (start, resume or end: one start or resume a rank an attempt), world,
        config_hash, step, attempt (0, 1, ...: this rank's starts and resumes before it);
        events_kept (bytes): an attempt that continues a run (resume from a checkpoint, or a
        start over in place) says how much of this rank's file stands: the events from that
        byte up to this one belong to a lost attempt and readers drop them (the file is never
        truncated: a live reader may have read them); slurm_restart: SLURM_RESTART_COUNT
  fault step, what (e.g. corrupt), scale       (injected faults, lowband/faults.py)
  skip  step, what, fragment: an update skipped: for NaN or inf (what: gradient,
        pseudo-gradient), or a failed --elastic commit vote (what: commit)
  checkpoint step, path
  guard step, fragment, left_out, why, text, ...: an update the guard left out of a merge
        (algorithms/guard.py, docs/faults.md)
  rollback step, to_step, val_loss, syncs_undone, text, ...: --rollback restored the outer state
  shard state_bytes, unsharded_state_bytes, master_bytes, ...  (zero1/acco, once at set-up)
Readers skip a torn last line, damaged lines, unknown fields and unknown kinds.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

from lowband.options import ConfigError

SCHEMA_VERSION = 1
KINDS = ("step", "comm", "sync", "eval", "spike", "run", "fault", "skip", "checkpoint",
         "shard", "memory", "setup", "membership", "quorum", "late", "rejoin", "guard",
         "rollback")


class RunDir:
    """Paths inside one run directory."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def events(self) -> Path:
        return self.root / "events"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def groups(self) -> Path:
        """--elastic: each replica group's ranks (groups/replica<i>.json), merged into summary.json"""
        return self.root / "groups"

    def group_record(self, replica: int) -> Path:
        """--elastic: the record a replica group writes when it finishes."""
        return self.groups / f"replica{replica}.json"

    def group_records(self) -> dict[int, Path]:
        """--elastic: the finished groups' records, by replica, in replica order."""
        found = {int(p.stem[len("replica"):]): p for p in self.groups.glob("replica*.json")}
        return dict(sorted(found.items()))

    def clear_group_records(self) -> None:
        """--elastic, as a launch begins: records of an earlier launch of this run (a resumed
        one) are not this launch's results; each group writes its own again when it finishes.
        (groups/left-out.json stays: the events of the work it names stay too.)"""
        for path in self.group_records().values():
            path.unlink(missing_ok=True)

    @property
    def left_out(self) -> Path:
        """--elastic: each group left out at the end, and why (launch/supervise.py)."""
        return self.groups / "left-out.json"

    @property
    def lighthouse_life(self) -> Path:
        """--elastic: how often the Lighthouse was restarted (comm/membership/lives.py)."""
        return self.logs / "lighthouse-life"

    @property
    def lighthouse_down(self) -> Path:
        """--elastic: seconds each restart left the groups without a Lighthouse."""
        return self.logs / "lighthouse-down.json"

    def event_file(self, rank: int) -> Path:
        return self.events / f"rank{rank}.jsonl"

    def count_events(self, rank: int, kind: str, *phases: str) -> int:
        """Events of `kind` (with `phases`: of one of those phases) in this rank's event file,
        lost attempts' included (read_events drops those), read as raw lines."""
        kind_b = f'"kind":"{kind}"'.encode()
        phases_b = [f'"phase":"{p}"'.encode() for p in phases]
        try:
            with open(self.event_file(rank), "rb") as f:
                return sum(1 for line in f if kind_b in line and (
                    not phases_b or any(p in line for p in phases_b)))
        except OSError:
            return 0

    def create(self) -> "RunDir":
        for d in (self.root, self.events, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        return self

    # what a run leaves at the top of its directory (report.html: the report every run writes)
    RUN_FILES = ("config.json", "summary.json", "model.pt", "outer.pt", "report.html")

    def holds_run(self) -> bool:
        """Whether a run has written here. Empty directories, and logs/ alone (a launcher
        makes both before its workers start), are no run."""
        return (any((self.root / name).exists() for name in self.RUN_FILES)
                or any(self.events.glob("rank*.jsonl"))
                or (self.checkpoints.is_dir() and any(self.checkpoints.iterdir())))

    def trained(self) -> bool:
        """Whether a run took a step here (a step event, a checkpoint or a result): a directory
        made for a run refused before its first step holds none, and its launcher removes it."""
        return (any((self.root / n).exists() for n in self.RUN_FILES if n != "config.json")
                or (self.checkpoints.is_dir() and any(self.checkpoints.iterdir()))
                or any(self.count_events(int(p.stem[len("rank"):]), "step")
                       for p in self.events.glob("rank*.jsonl")))

    def clear(self) -> None:
        """Remove what a run left here: its files, events, checkpoints and workers' logs."""
        for name in self.RUN_FILES:
            (self.root / name).unlink(missing_ok=True)
            for tmp in self.root.glob(f"{name}.tmp*"):  # a write killed mid-way (atomic_path)
                tmp.unlink(missing_ok=True)
        for d in (self.events, self.checkpoints, self.groups):
            shutil.rmtree(d, ignore_errors=True)
        for log in [*self.logs.glob("rank*.log"), *self.logs.glob("replica*.log"),
                    *self.logs.glob("kill*-*"), *self.logs.glob("lighthouse*")]:
            log.unlink(missing_ok=True)

    def claim(self, overwrite: bool) -> "RunDir":
        """Make this the directory of a new run: refused (ConfigError) where a run already
        is, unless `overwrite`, which removes that run first."""
        if self.holds_run():
            if not overwrite:
                raise ConfigError(f"{self.root} already holds a run: pass --overwrite to replace "
                                  f"it, --resume {self.root} to continue it, or another --run-dir.")
            self.clear()
        return self.create()

    def read_json(self, path: Path) -> dict | None:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None


def to_make(path: Path) -> list[Path]:
    """path and those of its parents that do not exist yet, deepest first: the directories
    making it creates, which a refused run removes again (unmake)."""
    made = []
    for p in [Path(path), *Path(path).parents]:
        if p.exists() or p.is_symlink():
            break
        made.append(p)
    return made


def unmake(run: RunDir, made: list[Path]) -> None:
    """A run refused before its first step leaves no directory it made: unless a step was taken
    in it (RunDir.trained), the run directory goes whole where it was made for the run (`made`,
    deepest first, from to_make), else what the run wrote in it (RunDir.clear); then the new
    parents, while empty (another run may have started in one meanwhile)."""
    if run.trained():
        return
    if made and made[0] == run.root:
        shutil.rmtree(run.root, ignore_errors=True)
        made = made[1:]
    else:
        run.clear()
        made = [run.logs, run.events, run.checkpoints, *made]
    for d in made:
        try:
            d.rmdir()
        except FileNotFoundError:
            pass
        except OSError:  # not empty: another run's, or the user's own files
            if d not in (run.logs, run.events, run.checkpoints):
                return


def new_run_dir(algo: str) -> RunDir:
    """A fresh runs/<algo>-<time> (with -2, -3, ... when that name is taken), created at once
    so that two runs started in the same second never share it."""
    base = os.path.join("runs", f"{algo}-{time.strftime('%Y%m%d-%H%M%S')}")
    for n in range(1, 1000):
        root = Path(base if n == 1 else f"{base}-{n}")
        try:
            root.mkdir(parents=True)
        except FileExistsError:
            continue
        return RunDir(root).create()
    raise ConfigError(f"runs/ has no free name like {base}: pass --run-dir.")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """A temporary name beside `path` for a result file written whole: the block writes it,
    then it is synced to disk and renamed onto `path`, so a reader, a crash or a full disk
    finds the old file or the new one, never half of one. On failure the temporary file is
    removed and the OSError (also one torch.save raised a RuntimeError from) names `path`."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        fault = os_fault(e, path)  # (before the removal frees the disk)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if fault is not None:
            raise fault from e
        raise
    with contextlib.suppress(OSError):  # the rename itself outlives a power cut
        _fsync(path.parent)


def os_fault(e: BaseException, path: str | os.PathLike) -> OSError | None:
    """The filesystem's fault under a failed write of `path`, as an OSError naming `path`
    (lowband tells it in one sentence: options.filesystem_error), or None: `e` itself, an error
    it was raised from (torch.save raises a RuntimeError from a full disk's OSError), a failed
    DCP save's ranks' (CheckpointException.failures), or Rust's words for one ("(os error 28)":
    safetensors); where the writer lost it (DCP's writers), a full disk is told by its free
    blocks."""
    if isinstance(e, (KeyboardInterrupt, SystemExit)):
        return None
    for err in [f[0] for f in getattr(e, "failures", {}).values()] or [e]:
        seen = set()
        while err is not None and id(err) not in seen:
            seen.add(id(err))
            if isinstance(err, OSError) and err.errno is not None:
                return OSError(err.errno, err.strerror, os.fspath(path))
            rust = re.search(r"\(os error (\d+)\)", str(err))
            if rust:
                code = int(rust.group(1))
                return OSError(code, os.strerror(code), os.fspath(path))
            err = err.__cause__ or err.__context__
    try:
        if os.statvfs(Path(path).parent).f_bavail == 0:
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))
    except OSError:
        pass
    return None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj) -> None:
    """Write beside, then rename (atomic_path): a reader sees the old file or the new one,
    never half."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


class EventWriter:
    """Appends one rank's events to its JSONL file; safe to call from communication threads."""

    def __init__(self, run_dir: RunDir, rank: int, replica: int):
        self.rank, self.replica = rank, replica
        run_dir.events.mkdir(parents=True, exist_ok=True)
        path = run_dir.event_file(rank)
        self._file = open(path, "a", buffering=1)
        if self._file.tell() > 0:  # a crash may have torn the last line: end it, readers skip it
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    self._file.write("\n")
        self._lock = threading.Lock()

    def emit(self, kind: str, **fields) -> dict:
        event = {"v": SCHEMA_VERSION, "t": time.time(), "rank": self.rank,
                 "replica": self.replica, "kind": kind, **fields}
        line = json.dumps(event, separators=(",", ":")) + "\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(line)
        return event

    # The events every loop writes (the trainer's, lowband.Sync's and testing/synthetic.py's
    # runs), by their fields: a field cannot go missing from one writer. more: a synthetic run's
    # own time (t=) or a field beyond the contract's.

    def emit_step(self, step: int, loss: float, lr: float, tokens: int, step_s: float,
                  compute_s: float, elapsed_s: float, **more) -> dict:
        return self.emit("step", step=step, loss=loss, lr=lr, tokens=tokens, step_s=step_s,
                         compute_s=compute_s, elapsed_s=elapsed_s, **more)

    def emit_eval(self, step: int, val_loss: float, **more) -> dict:
        """more: elapsed_s, and where every rank evaluated, tokens and outer_bytes (ledger.py)."""
        return self.emit("eval", step=step, val_loss=val_loss, **more)

    def emit_run(self, phase: str, world: int, config_hash: str, **more) -> dict:
        """more: step and the attempt's fields (start, resume: checkpoint/lifecycle.py)."""
        return self.emit("run", phase=phase, world=world, config_hash=config_hash, **more)

    def emit_checkpoint(self, step: int, path: str, **more) -> dict:
        return self.emit("checkpoint", step=step, path=path, **more)

    def close(self) -> None:
        with self._lock:
            self._file.close()


class EventTail:
    """Incremental reader of a run's event files by byte offset.

    poll() returns the events appended since the last call. A last line without its newline is
    being written (or was torn by a crash): it is left for the next poll, never parsed half.
    Events of a lost attempt (before a `run` event's events_kept byte) are dropped, and that run
    event gets `superseded_to`, the last step the lost attempt reached; when an earlier poll had
    already returned some of them, `rewound` turns True: the reader should start over with a
    new EventTail (what a fresh read returns is the run without the lost attempts).
    """

    def __init__(self, run_dir: str | os.PathLike | RunDir):
        self.run_dir = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
        self.offsets: dict[Path, int] = {}  # bytes of each file consumed so far
        self.rewound = False

    def poll(self, kinds: tuple[str, ...] = KINDS) -> list[dict]:
        out: list[dict] = []
        if not self.run_dir.events.is_dir():
            return out
        for path in sorted(self.run_dir.events.glob("rank*.jsonl")):
            offset = self.offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except OSError:
                continue
            end = chunk.rfind(b"\n")
            if end < 0:
                continue
            self.offsets[path] = offset + end + 1
            mine: list[tuple[int, dict]] = []  # (byte position, event) read from this file now
            pos = offset
            for line in chunk[: end + 1].splitlines(keepends=True):
                event = parse_event(line)
                if event is not None:
                    kept = event.get("events_kept") if event["kind"] == "run" else None
                    if isinstance(kept, int) and not isinstance(kept, bool) and kept < pos:
                        self.rewound |= kept < offset
                        lost = [e["step"] for p, e in mine if p >= kept and e["kind"] == "step"]
                        if lost:
                            event["superseded_to"] = max(lost)
                        mine = [(p, e) for p, e in mine if p < kept]
                    mine.append((pos, event))
                pos += len(line)
            out.extend(e for _, e in mine if e["kind"] in kinds)
        return out


def parse_event(line: bytes | str) -> dict | None:
    """One event from one line, or None for a damaged line or one without the common fields."""
    try:
        event = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(event, dict):
        return None
    if not all(k in event for k in ("v", "t", "rank", "kind")):
        return None
    return event


def read_events(run_dir: str | os.PathLike | RunDir, kinds: tuple[str, ...] = KINDS) -> list[dict]:
    """Every complete event of a run, ordered by time."""
    events = EventTail(run_dir).poll(kinds)
    events.sort(key=lambda e: e["t"])
    return events
