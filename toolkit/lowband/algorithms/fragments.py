"""A model's fragments, as diloco and streaming keep them (streaming.py): each fragment's
parameters, this rank's slice of its flat vector (1/S of it with S ranks a replica) with its
outer parameters and momentum, and what flows between the slices and the whole: `Fragmented`
gathers a fragment over the fast inner link, takes a norm over every slice, and gives the outer
parameters by name (to evaluate them, or for outer.pt)."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from lowband.algorithms.outer import kept_at
from lowband.params import flatten, write_flat


class Fragment:
    def __init__(self, index: int, params: list, shard: int, shards: int, device):
        self.index, self.params = index, params
        self.numel = sum(p.numel() for p in params)
        self.chunk = math.ceil(self.numel / shards)
        self.lo = min(shard * self.chunk, self.numel)
        self.hi = min(self.lo + self.chunk, self.numel)
        self.outer = kept_at(self.local_slice(), device)  # theta_outer, this rank's slice
        self.momentum = kept_at(torch.zeros_like(self.outer, device=params[0].device), device)
        self.residual = None  # error feedback: what quantization left out of the last send
        self.rest = None  # --outer-update eager: the averages' part not applied yet (eager.py)
        self.pending = None  # (apply after step, start step, Average in flight)
        self.tokens = 0  # this replica's tokens since the fragment's last sync (--merge-weights)
        self.lr_sum = 0.0  # the inner learning rates' sum over those steps (--guard)
        self.outer_steps = 0  # Nesterov outer steps taken (--outer-warmup's k)

    def local_slice(self) -> torch.Tensor:
        return flatten(self.params)[self.lo: self.hi]


class Fragmented:
    """For an algorithm with `fragments`, `topo`, `comm`, `staging` and `model`."""

    def _gather(self, f: Fragment, piece: torch.Tensor) -> torch.Tensor:
        """The whole fragment from every shard's slice (over the fast inner link)."""
        if self.topo.shards == 1:
            return piece
        padded = F.pad(piece, (0, f.chunk - piece.numel()))
        parts = self.comm.all_gather(padded, "inner", tag=f"frag{f.index}").wait()
        return torch.cat(parts)[: f.numel]

    def _norm(self, delta: torch.Tensor) -> float:
        """Norm of the averaged pseudo-gradient over the whole fragment (all slices)."""
        sq = delta.double().pow(2).sum().reshape(1)
        if self.topo.shards > 1:
            sq = torch.cat(self.comm.all_gather(sq.to(self.topo.device), "inner", tag="norm").wait())
        return float(sq.sum().sqrt())

    def outer_params(self) -> dict[str, torch.Tensor]:
        """The full outer parameters by name (gathered over the inner group when sharded)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        out = {}
        for f in self.fragments:
            full = self._gather(f, self.staging.get(f.outer, keep=False))
            offset = 0
            for p in f.params:
                out[names[id(p)]] = full[offset: offset + p.numel()].view_as(p).clone()
                offset += p.numel()
        return out

    @contextlib.contextmanager
    def eval_weights(self, which: str):
        if which != "outer":
            yield
            return
        saved = [flatten(f.params) for f in self.fragments]
        outer = self.outer_params()
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(outer[name])
        try:
            yield
        finally:
            for f, flat in zip(self.fragments, saved):
                write_flat(f.params, flat)
