"""What edit (and aedit) hold a unit at a time, and how a replica is sharded: a Unit is one
FSDP unit (the root's own parameters, or one block) with this rank's piece of it and of its
outer state; Landed and Summed are exchanges in flight as the unit's apply reads them;
`shard_replica` applies FSDP2 over a replica's S ranks (edit.py skips it at S = 1);
`sync_schedule` is what a sync sends over the outer link, for the planner."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import math

from lowband.algorithms.outer import kept_at
from lowband.comm.sends import Schedule, Send, average, exchange_phases
from lowband.comm.wire import wire_bytes
from lowband.algorithms.penalty import EWMA
from lowband.options import ConfigError
from lowband.params import local_piece


class Summed:
    """An encoded average in flight as a sum: its mean times the rows summed (each replica sent
    its weighted pseudo-gradient, so the weighted average is their sum)."""

    def __init__(self, avg, n: int):
        self.avg, self.n = avg, n

    def wait(self) -> torch.Tensor:
        return self.avg.wait().mul_(self.n)


class Unit:
    """One FSDP unit (the root's own parameters or one block): this rank's shard of it and of
    its outer state."""

    def __init__(self, name, params: list[nn.Parameter], device: torch.device):
        self.name, self.params = name, params
        self.tag = name if isinstance(name, str) else f"block{name}"
        self.numel = sum(p.numel() for p in params)  # whole unit, all shards
        flat = self.local_flat()
        self.outer = kept_at(flat, device)
        self.momentum = kept_at(torch.zeros_like(flat), device)
        self.ewma = EWMA()
        self.pending = None  # the exchange in flight (Transfer, Summed or Landed)
        self.residual = None  # error feedback (an encoded --codec): what was not sent

    def locals(self) -> list[torch.Tensor]:
        return [local_piece(p) for p in self.params]

    def local_flat(self) -> torch.Tensor:
        pieces = [t.detach().reshape(-1).float() for t in self.locals()]
        return torch.cat(pieces) if pieces else torch.zeros(0)

    def full_outer(self, device: torch.device) -> list[torch.Tensor]:
        """The unit's outer parameters by parameter, whole (a sharded one gathered over the
        inner group), on `device`."""
        from torch.distributed.tensor import DTensor

        out, offset = [], 0
        for p, loc in zip(self.params, self.locals()):
            piece = self.outer[offset: offset + loc.numel()].view_as(loc).to(device)
            offset += loc.numel()
            if isinstance(p, DTensor):
                piece = DTensor.from_local(piece, p.device_mesh, p.placements, shape=p.shape,
                                           stride=p.stride()).full_tensor()
            out.append(piece.detach().clone())
        return out

    @torch.no_grad()
    def write(self, flat: torch.Tensor) -> None:
        offset = 0
        for t in self.locals():
            t.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()


def shard_replica(model: nn.Module, blocks: nn.ModuleList, topology) -> None:
    """FSDP2 over the replica's S ranks: `fully_shard` on every block, then on the root, with
    the 1-D "shard" sub-mesh."""
    from torch.distributed.fsdp import fully_shard  # imported when used: slow to import

    if topology.device.type == "cuda" and dist.get_backend() == "gloo":
        raise ConfigError(f"edit with --shards {topology.shards} on GPUs shared by several ranks "
                          "cannot run: FSDP2's collectives crash in gloo with CUDA tensors "
                          "(NCCL needs one GPU a rank), so use --shards 1 or one GPU per rank.")
    mesh = topology.mesh["shard"]
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def outer_memory(units: list[Unit], shards: int, device: torch.device, allocated: int) -> dict:
    """The `memory` event of the outer state: the bytes its tensors' storages hold (every unit's
    outer parameters and momentum), against 2 x 4 bytes x params / S."""
    storages = {}
    for u in units:
        for t in (u.outer, u.momentum):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    n_params = sum(u.numel for u in units)
    held, expected = sum(storages.values()), 2 * 4 * n_params / shards
    fields = {"what": "outer_state", "bytes": held, "n_params": n_params, "shards": shards,
              "device": device.type, "expected_bytes": expected, "ratio": held / expected}
    if device.type == "cuda":
        fields["allocated_bytes"] = allocated
    return fields


def allocated_bytes(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def sync_schedule(run, sync_every: int, extras: int) -> Schedule:
    """edit's outer link (edit.py's docstring has the sync), in units of a third of a block's
    compute: a step is L forward units (block u's forward is unit u) and 2L backward units.
    After every `sync_every` steps, at the end of the last backward unit: the prepare
    all-gather over all R x S ranks (float64: each unit's norm and `extras` numbers), waited
    for; once it has arrived the root unit's and block 0's exchanges leave (block 0's forward
    waits for both); block 1's once the root's has arrived (block 0's hook, after the root's
    wait), and block u's (u >= 2) at the end of block u - 2's forward, when block u - 1's hook
    runs; block u's forward waits for it. Each rank sends its 1/S of a unit over the outer group
    of R ranks, as Comm.average sends it (an fp32 all-reduce, or a codec's exchange)."""
    L, S, T = run.layers, run.shards, run.step_time
    units, u_s = 3 * L, T / (3 * L)
    root, *blocks = (math.ceil(n / S) for n in run.unit_sizes)
    prepare = wire_bytes("all_gather", 8 * (L + (root > 0) + extras), run.world)
    first = [exchange_phases(run, root) if root else (), exchange_phases(run, blocks[0])]
    sends, at = [Send(u_s, prepare, 1)], [[], []]
    for phase in range(max(map(len, first))):  # the root's and block 0's, phase by phase
        for i, phases in enumerate(first):
            if phase < len(phases):
                at[i].append(len(sends))
                sends.append(Send(0.0, phases[phase], 1, at[i][-2] if phase else 0))
    if L > 1:  # block 1: once the root's exchange (or, without root parameters, the prepare)
        sends += average(run, blocks[1], 2, 0.0, (at[0] or [0])[-1], len(sends))
    period = sync_every * units
    later = tuple(average(run, n, 2, u_s) for n in blocks[2:])  # from units 0 .. L-3
    return Schedule(u_s, units, period, (*range(L - 2), period - 1), (*later, tuple(sends)),
                    first=period - 1)
