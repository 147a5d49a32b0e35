"""Checkpoints: everything a run needs to continue exactly where it was.

runs/<name>/checkpoints/step-00000040/
    .metadata, *.distcp     model and inner optimizer, torch.distributed.checkpoint; keys are
                            prefixed replica<k>. because replicas of local-SGD algorithms differ
    rank<r>.pt              this rank's algorithm state (outer parameters, momentum, exchanges
                            in flight already landed, ...), step, RNG states, counters of the
                            summary, and the size of its event file at this step
    manifest.json           {"sha256": {file: hex digest}} of every file above

A checkpoint is written into step-XXXXXXXX.tmp and made current by one rename on rank 0, so a
crash mid-write leaves the previous checkpoint as the latest loadable one; a leftover .tmp is
ignored and cleared by the next save (a save that fails, on a full disk say, removes it). The
last `keep` checkpoints are kept. Everything is loaded with weights_only=True (DCP's own
non-tensor items too, see _WeightsOnlyPlanner).

Before a resume, `newest_intact` checks each checkpoint's files against its manifest, newest
first, and passes over damaged ones; checkpoints written before manifests existed are taken as
they are (a damaged one then fails in `load` with one sentence).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from lowband.options import ConfigError
from lowband.telemetry import RunDir, os_fault


def _weights_only_planner():
    """DCP's default planner unpickles the non-tensor items (optimizer hyper-parameters) with
    weights_only=False; these bytes must first load with weights_only=True. (DCP is imported
    when a checkpoint is made or read: it is slow to import, and most runs make none.)"""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class WeightsOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            data = value.read()
            torch.load(io.BytesIO(data), weights_only=True)  # refuses anything but plain data
            super().load_bytes(read_item, io.BytesIO(data))

    return WeightsOnlyPlanner()


MANIFEST = "manifest.json"


def home(run: RunDir, group: int | None = None) -> Path:
    """Where a run's checkpoints are: RUN/checkpoints, or with --elastic, where each replica
    group is a world of its own that checkpoints on its own, RUN/checkpoints/replica<group>."""
    return run.checkpoints if group is None else run.checkpoints / f"replica{group}"


def complete(run: RunDir, group: int | None = None) -> list[Path]:
    """A run's complete checkpoints (made current by their rename), oldest first."""
    where = home(run, group)
    if not where.is_dir():
        return []
    return sorted(p for p in where.glob("step-*")
                  if p.is_dir() and not p.name.endswith(".tmp") and (p / ".metadata").exists())


def latest(run: RunDir, group: int | None = None) -> Path | None:
    """The newest complete checkpoint of a run (of an elastic run's replica group), or None."""
    done = complete(run, group)
    return done[-1] if done else None


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_manifest(path: Path) -> None:
    digests = {p.name: _sha256(p) for p in sorted(path.iterdir()) if p.is_file()}
    (path / MANIFEST).write_text(json.dumps({"sha256": digests}, indent=1) + "\n")


def damage(path: Path) -> str | None:
    """What is wrong with a checkpoint's files (a few words), or None when each matches the
    checksum its manifest recorded, or when it has no manifest (written before them)."""
    if not (path / MANIFEST).exists():
        return None
    try:
        digests = json.loads((path / MANIFEST).read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"its {MANIFEST} cannot be read"
    for name, digest in digests.items():
        try:
            if _sha256(path / name) != digest:
                return f"{name} does not match its checksum"
        except OSError:
            return f"{name} is missing"
    return None


def newest_intact(run: RunDir, group: int | None = None) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint whose files match their checksums (None if there is none), and
    the newer ones passed over, each with what is wrong with it."""
    damaged = []
    for path in reversed(complete(run, group)):
        why = damage(path)
        if why is None:
            return path, damaged
        damaged.append((path, why))
    return None, damaged


def _model_state(model, optimizer, replica: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    return {f"replica{replica}": {"model": msd, "optim": osd}}


def save(run: RunDir, step: int, model, optimizer, algo, replica: int, extra,
         keep: int, crash_before_rename: bool = False, group: int | None = None) -> Path:
    """Collective: every rank (of the world; with --elastic, of the replica `group`) calls it
    after the same step. extra(): this rank's state beside the algorithm's, taken after the
    algorithm's (which lands exchanges in flight: their bytes and events belong to it)."""
    import torch.distributed.checkpoint as dcp

    final = home(run, group) / f"step-{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = {"algorithm": algo.state_dict()}  # drains exchanges in flight first
    state.update(extra())
    try:
        dcp.save(_model_state(model, optimizer, replica), checkpoint_id=tmp)
        with open(tmp / f"rank{rank}.pt", "wb") as f:  # (a file: a full disk's OSError is kept)
            torch.save(state, f)
        dist.barrier()
        if crash_before_rename:  # --crash-checkpoint: what the atomic rename protects against
            os._exit(17)
        if rank == 0:
            _write_manifest(tmp)  # every rank's files are complete after the barrier
    except BaseException as e:
        fault = os_fault(e, final)  # (before the removal frees the disk)
        if rank == 0:  # no half-written checkpoint is left behind
            shutil.rmtree(tmp, ignore_errors=True)
        if fault is not None:
            raise fault from e
        raise
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(p for p in final.parent.glob("step-*") if p.is_dir())[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def read_rank_state(path: Path, rank: int) -> dict:
    try:
        return torch.load(path / f"rank{rank}.pt", weights_only=True)
    except FileNotFoundError:
        raise ConfigError(f"checkpoint {path} has no state for rank {rank}: resume with the "
                          "same number of ranks the run was written with.") from None
    except Exception as e:  # a damaged or foreign file
        raise ConfigError(f"checkpoint {path} cannot be read ({type(e).__name__}): remove it "
                          "to resume from the one before.") from None


def load(path: Path, model, optimizer, algo, replica: int, rank_state: dict) -> None:
    """Collective: fill the model, optimizer and algorithm from a checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _model_state(model, optimizer, replica)
    try:
        dcp.load(state, checkpoint_id=path, planner=_weights_only_planner())
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise ConfigError(f"checkpoint {path} cannot be loaded ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]}): remove it to resume from the one "
                          "before.") from None
    mine = state[f"replica{replica}"]
    set_state_dict(model, optimizer, model_state_dict=mine["model"], optim_state_dict=mine["optim"])
    algo.load_state_dict(rank_state["algorithm"])


def user_state(objects: dict | None) -> dict:
    """A lowband.Sync user's own objects (state=), each its state_dict (plain data and tensors),
    for a checkpoint and a heal."""
    return {key: obj.state_dict() for key, obj in (objects or {}).items()}


def load_user_state(objects: dict | None, state: dict) -> None:
    """user_state's inverse: each object loads its own part."""
    for key, obj in (objects or {}).items():
        obj.load_state_dict(state[key])
