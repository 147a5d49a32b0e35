"""A run's lifecycle, decided before the trainer's loop: which run directory (claimed, or a
fresh runs/<algo>-<time>), whether this start continues a run (--resume, --auto-resume, a Slurm
restart), which attempt it is, and the checkpoint it resumes from. Rank 0 decides each and
tells the others (`decided_by_rank0`), so every rank stops with the same sentence or goes on
with the same answer."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from lowband import checkpoint
from lowband.config import RESUME_MAY_CHANGE, RESUME_RULE, Config, ConfigError, fields
from lowband.options import filesystem_error
from lowband.telemetry import RunDir, new_run_dir

RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"  # torchrun's count of a worker group's restarts


@dataclass
class Start:
    """Where this process starts: the run directory, the checkpoint it resumes from (its path
    and this rank's state in it) if any, and the attempt's fields for the `run` event."""
    run: RunDir
    resume_from: tuple[Path, dict] | None = None
    attempt: dict = field(default_factory=dict)


def begin(cfg: Config, topo, resume: bool = False) -> Start:
    """The run directory, the resume point and the attempt of this start. resume: continue
    cfg.run_dir from its latest checkpoint; a relaunch (`relaunched`) continues it too."""
    restart = cfg.elastic and decided_by_rank0(restarted_group)
    resume = resume or restart or decided_by_rank0(lambda: relaunched(cfg))
    start = Start(resolve_run_dir(cfg, resume))
    if restart:
        start.attempt["restart"] = True
    if resume:
        path = resume_point(start.run, group(cfg, topo), required=resume is True and not restart)
        if path is not None:  # the events after the checkpoint belong to a lost attempt
            start.resume_from = (path, checkpoint.read_rank_state(path, dist.get_rank()))
            start.attempt["events_kept"] = start.resume_from[1]["events_offset"]
        elif not cfg.elastic:  # relaunched before its first checkpoint: start over in place
            start.attempt["events_kept"] = 0
    start.attempt["attempt"] = decided_by_rank0(lambda: attempts_before(start.run, topo.rank))
    if slurm_restarts():
        start.attempt["slurm_restart"] = slurm_restarts()
    return start


def restarted_group() -> bool:
    """(--elastic) This start is a replica group started again after it died: its launcher
    (`lowband train`'s supervisor, or the node agent's torchrun) counts the group's lives in
    TORCHELASTIC_RESTART_COUNT, so a death after an explicit --resume is a restart too, and the
    --resume itself is not. It continues from its newest intact checkpoint when it has one (a
    live peer that trained further replaces that state in the first quorum); without one it
    starts afresh and heals. On Slurm each group is a job of its own (launch/slurm.py), which
    Slurm requeues when its node is lost: SLURM_RESTART_COUNT counts those lives."""
    return int(os.environ.get(RESTART_COUNT, 0) or 0) > 0 or slurm_restarts() > 0


def group(cfg: Config, topo) -> int | None:
    """With --elastic, this process's replica group: a world of its own, checkpointed apart."""
    return topo.replica if cfg.elastic else None


def resolve_run_dir(cfg: Config, resume: bool) -> RunDir:
    """Rank 0 picks the run directory (default: a fresh runs/<algo>-<time>), refuses one that
    holds another run unless --overwrite (or --resume) says what to do with it, and tells the
    others."""

    def pick():
        try:
            if not cfg.run_dir:
                return str(new_run_dir(cfg.algo).root)
            if not resume and not cfg.elastic:  # an elastic run's launcher claimed it for all
                RunDir(cfg.run_dir).claim(cfg.overwrite)
            return cfg.run_dir
        except OSError as e:  # a read-only disk, a file in the way: every rank stops with it
            fault = filesystem_error(e)
            if fault is None:
                raise
            raise ConfigError(str(fault)) from None

    cfg.run_dir = decided_by_rank0(pick)
    return RunDir(cfg.run_dir).create()


def slurm_restarts() -> int:
    """How many times Slurm has run this job before (a requeue, a preemption, a retry)."""
    return int(os.environ.get("SLURM_RESTART_COUNT", 0) or 0)


def relaunched(cfg: Config) -> str | bool:
    """'auto' when this process continues a run already in --run-dir: --auto-resume, or Slurm
    restarted the job (SLURM_RESTART_COUNT > 0), and the directory holds the same run. A
    directory holding another run is refused with one sentence (rank 0 decides)."""
    if not (cfg.auto_resume or slurm_restarts()) or not cfg.run_dir or cfg.overwrite:
        return False
    run = RunDir(cfg.run_dir)
    saved = run.read_json(run.config)
    if saved is None:
        return "auto" if run.holds_run() else False  # stopped before its config: start over
    saved.pop("meta", None)
    mine = {k: v for k, v in cfg.to_dict().items() if k not in RESUME_MAY_CHANGE}
    # an option newer than the saved run ran at its default there (as a --resume reads it)
    theirs = {**{f.name: f.default for f in fields() if f.name not in saved},
              **{k: v for k, v in saved.items() if k not in RESUME_MAY_CHANGE}}
    differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    if differ:
        raise ConfigError(f"{run.root} holds a run with other options (--{differ[0].replace('_', '-')}"
                          f" {theirs.get(differ[0])!r}, not {mine.get(differ[0])!r}), so it is not "
                          f"continued ({RESUME_RULE}): give another --run-dir, or --overwrite to "
                          "replace it.")
    return "auto"


def attempts_before(run: RunDir, rank: int) -> int:
    """This run's attempts so far: the starts and resumes in this rank's event file."""
    return run.count_events(rank, "run", "start", "resume")


def decided_by_rank0(decide):
    """decide() run on rank 0 and its result given to every rank; a ConfigError it raises is
    raised on every rank, so all of them stop with the same sentence."""
    box = [None, None]  # result, error
    if dist.get_rank() == 0:
        try:
            box[0] = decide()
        except ConfigError as e:
            box[1] = str(e)
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise ConfigError(box[1])
    return box[0]


def no_checkpoint(run: RunDir) -> ConfigError:
    return ConfigError(f"{run.root} has no checkpoint to resume from: train with "
                       "--checkpoint-every N to write them.")


def check_resumable(cfg: Config) -> None:
    """`lowband train --resume`, before any worker starts and before the run directory is
    touched: refused with one sentence when the run has no complete checkpoint (with
    --elastic: no replica group has one). The workers then pick the newest intact one."""
    run = RunDir(cfg.run_dir)
    groups = range(cfg.replicas) if cfg.elastic else [None]
    if not any(checkpoint.complete(run, g) for g in groups):
        raise no_checkpoint(run)


def resume_point(run: RunDir, group: int | None, required: bool = True) -> Path | None:
    """The newest checkpoint of the run (with --elastic, of this replica group) whose files
    match their checksums, chosen by rank 0; each newer, damaged one is named on rank 0's
    stderr. None: an elastic group that has none while others do starts afresh (and heals
    from a live peer in its first quorum); a relaunch (not `required`) with none starts over."""

    def pick():
        path, damaged = checkpoint.newest_intact(run, group)
        if path is None and not damaged and not required:
            return None
        if path is None and not damaged and group is not None and \
                any(p.parent.name != f"replica{group}" for p in run.checkpoints.glob("replica*/step-*")):
            return None
        if path is None and not damaged:
            raise no_checkpoint(run)
        if path is None:
            bad, why = damaged[0]
            raise ConfigError(f"every checkpoint of {run.root} is damaged (the newest, {bad.name}: "
                              f"{why}), so nothing can be resumed: start the run again with "
                              "--overwrite.")
        for bad, why in damaged:
            print(f"lowband: checkpoint {bad} is damaged ({why}), so the run resumes from "
                  f"{path.name}.", file=sys.stderr, flush=True)
        print(f"lowband: resuming {run.root} from step {int(path.name.split('-')[1])} "
              f"(checkpoint {path.name})", file=sys.stderr, flush=True)
        return str(path)

    path = decided_by_rank0(pick)
    return None if path is None else Path(path)
