"""Checkpoints: everything a run needs to continue exactly where it was.

runs/<name>/checkpoints/step-00000040/
    .metadata, *.distcp     model and inner optimizer, torch.distributed.checkpoint; keys are
                            prefixed replica<k>. because replicas of local-SGD algorithms differ
    rank<r>.pt              this rank's algorithm state (outer parameters, momentum, exchanges
                            in flight already landed, ...), step, RNG states, counters of the
                            summary, and the size of its event file at this step

A checkpoint is written into step-XXXXXXXX.tmp and made current by one rename on rank 0, so a
crash mid-write leaves the previous checkpoint as the latest loadable one; a leftover .tmp is
ignored and cleared by the next save. The last `keep` checkpoints are kept. Everything is
loaded with weights_only=True (DCP's own non-tensor items too, see _WeightsOnlyPlanner).
"""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from lowband.options import ConfigError
from lowband.telemetry import RunDir


class _WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default planner unpickles the non-tensor items (optimizer hyper-parameters) with
    weights_only=False; these bytes must first load with weights_only=True."""

    def load_bytes(self, read_item, value):
        data = value.read()
        torch.load(io.BytesIO(data), weights_only=True)  # refuses anything but plain data
        super().load_bytes(read_item, io.BytesIO(data))


def latest(run: RunDir) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    if not run.checkpoints.is_dir():
        return None
    done = sorted(p for p in run.checkpoints.glob("step-*")
                  if p.is_dir() and not p.name.endswith(".tmp") and (p / ".metadata").exists())
    return done[-1] if done else None


def _model_state(model, optimizer, replica: int) -> dict:
    msd, osd = get_state_dict(model, optimizer)
    return {f"replica{replica}": {"model": msd, "optim": osd}}


def save(run: RunDir, step: int, model, optimizer, algo, replica: int, extra: dict,
         keep: int, crash_before_rename: bool = False) -> Path:
    """Collective: every rank calls it after the same step."""
    final = run.checkpoints / f"step-{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = {"algorithm": algo.state_dict(), **extra}  # drains exchanges in flight first
    dcp.save(_model_state(model, optimizer, replica), checkpoint_id=tmp)
    torch.save(state, tmp / f"rank{rank}.pt")
    dist.barrier()
    if crash_before_rename:  # --crash-checkpoint: the fault the atomic rename protects against
        os._exit(17)
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(p for p in run.checkpoints.glob("step-*") if p.is_dir())[:-keep]:
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
    state = _model_state(model, optimizer, replica)
    try:
        dcp.load(state, checkpoint_id=path, planner=_WeightsOnlyPlanner())
    except Exception as e:
        raise ConfigError(f"checkpoint {path} cannot be loaded ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]}): remove it to resume from the one "
                          "before.") from None
    mine = state[f"replica{replica}"]
    set_state_dict(model, optimizer, model_state_dict=mine["model"], optim_state_dict=mine["optim"])
    algo.load_state_dict(rank_state["algorithm"])
