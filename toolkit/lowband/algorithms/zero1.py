"""zero1: ZeRO-1 data parallelism — optimizer states sharded over every rank, no overlap.

Every rank holds the whole model (it computes full gradients) but only 1/N of the fp32 master
parameters and of the optimizer state (N = world size, all R x S ranks). The flat parameter
vector (the parameters in the order of the trainer's optimizer groups: matrices and embeddings,
then norms' scales) is padded with zeros to N x chunk, chunk = ceil(n_params / N); rank r owns
elements [r·chunk, (r+1)·chunk). One step:

  1. each rank sums the gradients of its micro-batches (each micro-batch's loss is backpropagated
     unscaled) and puts that sum, with its micro-batch count, in a send buffer laid out as N
     pieces of chunk + 1 values: piece q is elements [q·chunk, (q+1)·chunk) of the flat gradient
     followed by the count;
  2. reduce-scatter the buffer over the world: rank r gets the sum over ranks of its piece and,
     in the last slot, the total micro-batch count C (no separate all-reduce for the counts);
  3. mean gradient g = sum / C, so every micro-batch of every rank weighs the same;
  4. clipping on the global norm: the squared norm of each rank's piece is all-reduced (one
     float64), g is scaled by min(1, clip / (norm + 1e-6)) as torch.nn.utils.clip_grad_norm_
     does; a non-finite norm skips the update (nothing changes; algo.skips counts it; the
     step is queued with the skip decided on the device, found_inf, and the host reads it
     once the parameters' write is queued); without clipping (--grad-clip 0) the norm's
     finiteness is all that is needed, and each rank sends 0 or inf (whether all its values
     are finite) in place of its squares;
  5. the shard optimizer steps the master shard (optim.py: AdamW with the trainer's lr schedule,
     betas, eps and per-group weight decay, or plain SGD with --shard-optimizer sgd);
  6. all-gather the updated shards; every rank writes the whole vector into its model.
A world of one skips the copies its collectives of one would make (_round).

Transfers go through Comm over the "world" group, so each rank's bytes are recorded as outer or
inner by its position in the ring (docs/run-directory.md), and the emulated link applies to the
outer ones. Tags: `grad` (reduce-scatter), `norm`, `params` (all-gather).

zero1 uses the trainer's batches exactly as ddp does: micro-batch m of step t is
batches.train(t, m), m < --grad-accum, so with the same flags it follows the same trajectory as
ddp (tests/test_acco.py checks both against one float64 reference).

The trainer's optimizer slot gets a placeholder (SGD with lr 0 over the model's parameters,
never stepped, no state): the real state is sharded and travels in state_dict().
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowband.algorithms.base import EVERY_STEP, Algorithm
from lowband.algorithms.optim import ShardOptimizer
from lowband.comm.sends import GRAD_BYTES, Schedule, chained
from lowband.comm.wire import wire_bytes
from lowband.models import lm_loss
from lowband.options import ConfigError, Options, option
from lowband.params import write_flat


class FlatLayout:
    """The parameters as one padded flat vector, and this rank's piece of it."""

    def __init__(self, groups: list[tuple[list[torch.nn.Parameter], float]], rank: int, world: int):
        self.params = [p for ps, _ in groups for p in ps]
        self.n = sum(p.numel() for p in self.params)
        self.world, self.rank = world, rank
        self.sent_count = 0  # the micro-batch count of the last fill_send
        self.chunk = math.ceil(self.n / world)
        self.lo = rank * self.chunk
        # (start, end, weight decay) of each optimizer group inside this rank's piece
        self.segments, offset = [], 0
        for ps, wd in groups:
            size = sum(p.numel() for p in ps)
            lo, hi = max(offset, self.lo), min(offset + size, self.lo + self.chunk)
            if lo < hi:
                self.segments.append((lo - self.lo, hi - self.lo, wd))
            offset += size

    def flat(self) -> torch.Tensor:
        """The parameters, padded to world x chunk (fp32)."""
        out = torch.zeros(self.world * self.chunk, dtype=torch.float32,
                          device=self.params[0].device)
        self._gather_into(out, lambda p: p.detach())
        return out

    def _gather_into(self, out: torch.Tensor, value) -> None:
        offset = 0
        for p in self.params:
            v = value(p)
            if v is None:
                out[offset: offset + p.numel()].zero_()
            else:
                out[offset: offset + p.numel()].copy_(v.reshape(-1))
            offset += p.numel()

    def fill_send(self, send: torch.Tensor, count: int) -> None:
        """Put the summed gradients and this rank's micro-batch count into the send buffer
        (world pieces of chunk + 1: gradient values, then the count). Each gradient is copied
        straight into its place (split where it straddles two pieces); the padding after the
        last parameter is never written, so it keeps the zeros the buffer was made with."""
        pieces = send.view(self.world, self.chunk + 1)
        offset = 0
        for p in self.params:
            g = None if p.grad is None else p.grad.reshape(-1)
            pos, end = offset, offset + p.numel()
            while pos < end:
                q, i = divmod(pos, self.chunk)
                stop = min(end, (q + 1) * self.chunk)
                dst = pieces[q, i: i + stop - pos]
                if g is None:
                    dst.zero_()
                else:
                    dst.copy_(g[pos - offset: stop - offset])
                pos = stop
            offset = end
        pieces[:, self.chunk].fill_(float(count))
        self.sent_count = count

    def write(self, full: torch.Tensor) -> None:
        write_flat(self.params, full[: self.n])


def optimizer_groups(make_optimizer, model) -> tuple[list, dict]:
    """The trainer's optimizer groups (parameters, weight decay) and its hyper-parameters: the
    sharded optimizer follows make_optimizer_factory, whatever it decides."""
    ref = make_optimizer(model.parameters())
    groups = [(list(g["params"]), float(g.get("weight_decay", 0.0))) for g in ref.param_groups]
    g0 = ref.param_groups[0]
    hyper = {"betas": tuple(g0.get("betas", (0.9, 0.999))), "eps": float(g0.get("eps", 1e-8))}
    del ref  # never stepped: it holds no state
    return [(ps, wd) for ps, wd in groups if ps], hyper


@dataclass
class ShardOptions(Options):
    title = "sharded optimizer"
    shard_optimizer: str = option("adamw", "optimizer of each rank's shard: adamw (the trainer's "
                                  "AdamW) or sgd (plain, no momentum)", ("adamw", "sgd"))


class ZeRO1(Algorithm):
    name = "zero1"
    own_loop_why = ("it shards the inner optimizer's state over a replica's ranks and builds that "
                    "optimizer itself, so it cannot step the optimizer you made")
    kind = EVERY_STEP
    options = (ShardOptions,)
    summary = "ZeRO-1: optimizer states sharded over every rank, gradients reduce-scattered"
    loss_fit = "ddp"  # the same mean gradient, sharded
    owns_step = True

    @classmethod
    def outer_link(cls, run):
        """One round after the backward pass, waited for by the next step."""
        T = run.step_time
        return Schedule(T, 1, 1, (0,), (chained(cls.round_bytes(run), 1, T),))

    @staticmethod
    def round_bytes(run) -> list[float]:
        """Wire bytes a rank sends in one round over the ring of all n = R x S ranks, one
        collective after the other: the reduce-scatter of n pieces of chunk + 1 values (the
        gradients and the count), the norm's all-reduce (one float64), the all-gather of the
        updated shards (chunk = ceil(params / n))."""
        n, g = run.world, GRAD_BYTES[run.grad_dtype]
        chunk = math.ceil(run.params / n)
        return [wire_bytes("reduce_scatter", n * (chunk + 1) * g, n), wire_bytes("all_reduce", 8, n),
                wire_bytes("all_gather", chunk * g, n)]

    def setup(self, model, blocks, make_optimizer, topology, comm, config):
        self.model, self.blocks, self.topo, self.comm, self.config = model, blocks, topology, comm, config
        self.device = topology.device
        groups, hyper = optimizer_groups(make_optimizer, model)
        self.layout = FlatLayout(groups, topology.rank, topology.world)
        L = self.layout
        master = L.flat()[L.lo: L.lo + L.chunk].clone()
        self.opt = ShardOptimizer(master, L.segments, config.shard_optimizer, hyper["betas"],
                                  hyper["eps"])
        self.send = torch.zeros(L.world * (L.chunk + 1), dtype=torch.float32, device=self.device)
        self.skips = 0
        self._report_memory()
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # placeholder, see above
        return self.optimizer

    def _report_memory(self) -> None:
        L, opt = self.layout, self.opt
        per_value = 2 if opt.kind == "adamw" else 0  # AdamW: two moments per parameter
        if self.comm.events is not None:
            self.comm.events.emit(
                "shard", algorithm=self.name, optimizer=opt.kind, world=L.world,
                n_params=L.n, shard_numel=L.chunk, state_bytes=opt.state_bytes(),
                unsharded_state_bytes=per_value * 4 * L.n, master_bytes=opt.master.numel() * 4)

    # -- one communication round: reduce-scatter, shard step, all-gather --------------------

    @torch.no_grad()
    def _round(self, comm, lr: float, commit: bool, prefix: str = ""):
        """Average the send buffer's gradients over the world, step the shard and gather the
        parameters. Returns (full flat parameters, skipped): skipped is a 0-d bool tensor on
        the device, read by the caller once it has queued what follows (the host does not
        wait for the norm before the step is queued: the step skips itself on the device).
        commit=False leaves the master shard and the optimizer state as they were (acco's
        estimate).

        A world of one (R = S = 1) makes no pass a collective of one would make for nothing:
        the reduce-scatter lands in the send buffer itself, the gathered parameters are the
        shard itself, a single micro-batch is not divided by its count of 1. The collectives
        are still called (and recorded, with no bytes), and every value is the same as
        through the copies. The parameters returned are then, when committed, the master
        shard itself: read them (write them into the model, or copy them) before the next
        committed round, and never write into them."""
        L = self.layout
        alone = L.world == 1
        recv = self.send if alone else torch.empty(L.chunk + 1, dtype=torch.float32,
                                                   device=self.device)
        comm.reduce_scatter(recv, self.send, "world", tag=prefix + "grad").wait()
        grad = recv[: L.chunk]
        if not (alone and L.sent_count == 1):  # x / 1 is x, bit for bit
            grad.div_(recv[L.chunk])  # mean over every micro-batch of every rank
        clip = self.config.grad_clip > 0
        if clip:  # the global norm, accumulated in float64
            sq = torch.linalg.vector_norm(grad, dtype=torch.float64).square().reshape(1)
        else:
            # without clipping only the norm's finiteness matters: a float64 sum of squares of
            # fp32 values cannot overflow, so it is finite exactly when every value is. One
            # pass: 0 if so, inf if not (summed over the world, as the squares would be)
            sq = torch.where(torch.isfinite(grad).all(), 0.0, math.inf).double().reshape(1)
        comm.all_reduce(sq, "world", tag=prefix + "norm").wait()
        norm = sq.sqrt()
        skipped = ~torch.isfinite(norm).reshape(())  # NaN or inf somewhere (on every rank)
        if clip:  # (NaN where skipped: the step then reads nothing)
            coef = (self.config.grad_clip / (norm + 1e-6)).clamp(max=1.0)
            grad.mul_(coef.to(grad.dtype))
        new = self.opt.update(grad, lr, commit, found_inf=skipped.float())
        parts = comm.all_gather(new, "world", tag=prefix + "params").wait()
        return (parts[0] if alone else torch.cat(parts)), skipped

    def _note_skip(self, skipped: bool, step: int) -> None:
        if skipped:
            self.skips += 1
            if self.comm.events is not None:
                self.comm.events.emit("skip", step=step + 1, what="gradient")
        else:
            self.skips = 0

    def train_step(self, step, batches, lr):
        cfg, model = self.config, self.model
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(cfg.grad_accum):
            x, y = batches.train(step, micro)
            loss = lm_loss(model, x, y, self.config.precision)
            loss.backward()
            loss_sum += loss.detach()
        self.layout.fill_send(self.send, cfg.grad_accum)
        model.zero_grad(set_to_none=True)
        full, skipped = self._round(self.comm, lr, commit=True)
        self.layout.write(full)
        self._note_skip(bool(skipped), step)  # the host waits here, with the step queued
        return loss_sum.item() / cfg.grad_accum, cfg.grad_accum

    # -- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        L = self.layout
        return {"world": L.world, "n": L.n, "skips": self.skips, "optimizer": self.opt.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        L = self.layout
        if (state["world"], state["n"]) != (L.world, L.n):
            raise ConfigError(f"the checkpoint's {self.name} state was written by {state['world']} "
                              f"ranks for {state['n']} parameters, not {L.world} for {L.n}: resume "
                              "with the same world and model.")
        self.skips = state["skips"]
        self.opt.load_state_dict(state["optimizer"])

