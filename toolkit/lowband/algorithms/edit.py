"""edit (EDiT, arXiv 2412.07210): local SGD over FSDP2-sharded replicas, synced layer by layer
during the forward pass, with the pseudo-gradient penalty (applied in edit_plan.py, its math in
penalty.py, or in penalty_reference.py with --edit-penalty reference). aedit (aedit.py) is this
class with syncs triggered by wall-clock time.

Sharding. Each replica group shards its model with FSDP2 over the "shard" dimension of the
R x S DeviceMesh (comm/topology.py): `fully_shard` on every block, then on the root, with the
1-D "shard" sub-mesh. So parameters, gradients and inner-optimizer state are split over the
replica's S ranks (the fast inner link), and nothing FSDP does crosses the outer link: replicas
train independently (FSDP2's own HSDP mode would all-reduce every gradient over replicas). Every
rank holds a shard of each FSDP unit, the unit being a block or the root's own parameters
(embeddings, final norm; the tied head is the embedding); rank (replica i, shard k) holds the
same slice as (replica j, shard k), so a unit's shard is averaged over the outer group.
With S = 1 a replica is one rank that holds its whole model, and FSDP2 (whose one-rank
collectives would still copy every unit and gradient each step) is not applied: the parameters
stay plain tensors, the inner AdamW is the trainer's plain one (fused on CUDA), a unit's
"shard" is the whole unit, and the syncs below are the same over whole units.

Outer state: the outer parameters and momentum as this rank's shards: 2 x params / S values a rank.

Warm-up: the first --warmup-sync-steps steps are synchronous data-parallel training (after FSDP's
reduce-scatter, the gradient shards are averaged over the outer group); the outer parameters are
then taken from the (identical) replicas.

A sync (after every H local steps; aedit: by time) happens in the forward pass of the next
step, layer by layer:
  prepare (before the forward)  every rank computes ||outer - local||^2 of its shard of every
                                unit; one small all-gather over all ranks gives each replica's
                                whole-unit norms (and the numbers aedit adds); every rank
                                decides the same from the same numbers (edit_plan.py): flags,
                                weights, statistics. The root unit's exchange is started.
  pre-forward hook of unit u    first starts unit u+1's exchange, then waits for unit u's and
                                applies it, so unit u+1's bytes travel while unit u computes.
  exchange of unit u            all-reduce of w_i x (outer - local) over the outer group (the
                                weighted average; a flagged replica sends zeros); a unit that
                                every replica was flagged on sends nothing.
  apply unit u                  clip the average to --edit-clip (its norm over the whole unit:
                                one scalar all-reduce over the inner group); Nesterov outer
                                step on the outer shard (--outer-lr, --outer-momentum); the local
                                shard <- the outer shard. Then FSDP's own pre-forward hook (which
                                runs after ours) all-gathers the synced unit.
Hooks go before FSDP2's (a unit is synced before FSDP all-gathers it); a unit the forward never
reached is applied before the backward, a sync due after the last step in finish().
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from lowband.algorithms.base import PERIODIC, Algorithm
from lowband.algorithms.edit_plan import (Plan, clip_scale, decide_sync, event_fields, extras_of,
                                         left_out, new_stats, penalty_config, plan_from_state,
                                         plan_state, stats_from_state)
from lowband.algorithms.guard import Guard, GuardOptions
from lowband.comm.exchanges import Landed
from lowband.algorithms.edit_units import (Summed, Unit, allocated_bytes, outer_memory,
                                          shard_replica, sync_schedule)
from lowband.algorithms.exchange import ExchangeOptions, exchange_block
from lowband.algorithms.outer import (OuterOptions, nesterov_step, outer_home, outer_momentum_at,
                                      settle, sgd_step)
from lowband.options import ConfigError, Options, non_negative, option, positive, require
from lowband.params import local_piece


@dataclass
class EditOptions(Options):
    title = "edit penalty and warm-up"
    warmup_sync_steps: int = option(0, "the first N steps are synchronous training over all "
                                    "ranks, local steps and syncs follow")
    edit_anomaly: bool = option(True, "leave a replica out of a block's average when its "
                                "pseudo-gradient norm is anomalous (EWMA z-score)")
    edit_ewma_rate: float = option(0.1, "rate of the norms' EWMA mean and variance")
    edit_z: float = option(3.0, "z-score above which a norm is anomalous")
    edit_anomaly_warmup: int = option(3, "syncs of a block before anomalies are acted on")
    edit_weighted: bool = option(True, "weigh replicas by softmax(-norm / T), else equally")
    edit_temperature: float = option(0.0, "T of the weights (0: the mean of the block's norms)")
    edit_clip: float = option(0.0, "clip a block's averaged pseudo-gradient to this norm (0: off)")
    edit_penalty: str = option("lowband", "the penalty's math: lowband's (pooled statistics, "
                               "renormalized weights) or reference, atorch's (a detector per "
                               "replica, raw norms, no renormalization; docs/fidelity.md)",
                               ("lowband", "reference"))

    @classmethod
    def check(cls, cfg) -> None:
        if not 0 <= cfg.warmup_sync_steps < cfg.steps:
            raise ConfigError(f"--warmup-sync-steps {cfg.warmup_sync_steps} must be at least 0 and "
                              f"below --steps {cfg.steps}, so that local steps remain.")
        if not 0 < cfg.edit_ewma_rate <= 1:
            raise ConfigError(f"--edit-ewma-rate must lie in (0, 1], got {cfg.edit_ewma_rate}.")
        require(cfg, ("edit_z",), positive, "positive")
        require(cfg, ("edit_anomaly_warmup", "edit_temperature", "edit_clip"), non_negative,
                "zero or positive")
        if getattr(cfg, "elastic", False) and cfg.edit_penalty == "reference":
            raise ConfigError("--edit-penalty reference keeps a detector per replica, which "
                              "--elastic's changing groups do not have: use --edit-penalty lowband.")
        if getattr(cfg, "elastic", False) and cfg.warmup_sync_steps:
            raise ConfigError("--warmup-sync-steps is synchronous training over every rank, which "
                              "--elastic groups do not have: drop one of them.")


class EDiT(Algorithm):
    name = "edit"
    own_loop_why = ("it shards the model with FSDP2 and builds the inner optimizer over the sharded "
                    "parameters, so the optimizer you made would step parameters no longer trained")
    kind = PERIODIC
    elastic = True
    options = (OuterOptions, ExchangeOptions, EditOptions, GuardOptions)
    defaults = {"codec": "fp32"}
    guard_default = "edit"  # --guard: its penalty (edit_plan.py), or the guard's norm rules
    summary = ("EDiT: local SGD over FSDP2-sharded replicas, layer-wise sync in the forward pass, "
               "pseudo-gradient penalty")
    timed = False  # aedit: syncs by wall-clock time

    @classmethod
    def outer_link(cls, run):
        """A sync every H steps, unit by unit in the next forward (edit_units.sync_schedule)."""
        return sync_schedule(run, run.sync_every, extras=0)

    def setup(self, model, blocks, make_optimizer, topology, comm, config):
        self.model, self.blocks, self.topo, self.comm, self.config = model, blocks, topology, comm, config
        c = config
        self.sharded = topology.shards > 1  # S = 1: the replica's one rank holds its whole model
        if self.sharded:
            shard_replica(model, blocks, topology)
        self.optimizer = make_optimizer(model.parameters())
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        root = [p for p in model.parameters() if id(p) not in in_blocks]
        self.device = topology.device
        outer_device = outer_home(c, topology.device)
        before = allocated_bytes(outer_device)
        candidates = [("root", model, root)] + [(i, b, list(b.parameters())) for i, b in enumerate(blocks)]
        self.units, self.unit_of = [], {}
        for name, module, params in candidates:
            if params:
                self.unit_of[module] = len(self.units)
                self.units.append(Unit(name, params, outer_device))
        allocated = allocated_bytes(outer_device) - before
        for module, u in self.unit_of.items():  # before FSDP's own pre-forward hook
            module.register_forward_pre_hook(functools.partial(self._hook, u), prepend=True)
        self.penalty = penalty_config(c, per_step=self.timed)
        self.guard = Guard(c, comm, topology)  # the records of the updates left out
        for u in self.units:
            u.ewma = new_stats(self.penalty, topology.replicas)
        self.anchored = False     # outer parameters taken from the replicas after the warm-up
        self.steps_done = 0
        self.last_prepared = -1   # steps done at the last sync
        self.syncs = 0
        self.plan: Plan | None = None  # the sync being applied
        self.started = self.applied = 0
        self.sync_info: dict = {}
        self.membership = comm.membership  # --elastic: the replicate dimension is torchft's
        self.me = topology.replica   # this replica's row in the sync's plan (elastic: per quorum)
        self.healed_in_quorum = [False] * topology.replicas  # per row: a copy healed in its quorum
        self._quorum_at = None       # steps done at the last quorum
        self._report_memory(allocated, outer_device)
        return self.optimizer

    def _reshard(self) -> None:
        """FSDP2's root back to its sharded parameters (after an evaluation's forward it stays
        unsharded, and its registered parameters are the unsharded ones); none where S = 1."""
        if self.sharded:
            self.model.reshard()

    def _report_memory(self, allocated: int, device: torch.device) -> None:
        fields = outer_memory(self.units, self.topo.shards, device, allocated)
        self.outer_state_bytes = fields["bytes"]
        if self.comm.events is not None:
            self.comm.events.emit("memory", **fields)

    # -- the trainer's hooks ------------------------------------------------------------------

    def should_stop(self, step):
        if step >= self.config.steps:
            return True
        if self._due(step) and self._quorum_at != step:
            self._quorum_at = step  # before the step reads its data: a group behind heals here
            self.membership.begin(step)
        return False

    def before_forward(self, step):
        self._reshard()
        self._anchor(step)
        if not self.timed and self._due(step):
            self._prepare(step)

    def before_backward(self, step, micro, last):
        if self.plan is not None:  # units the forward did not reach
            self._drain()

    def after_backward(self, step):
        if step < self.config.warmup_sync_steps and self.topo.replicas > 1:
            self._average_gradients()

    def after_step(self, step):
        if self.plan is not None:
            self._drain()
        self.steps_done = step + 1

    def finish(self):
        if self.plan is not None:
            self._drain()
        if not self.timed and self._due(self.steps_done):
            self._reshard()
            self._prepare(self.steps_done)
            self._drain()

    # -- warm-up ------------------------------------------------------------------------------

    def _anchor(self, step: int) -> None:
        if self.anchored or step < self.config.warmup_sync_steps:
            return
        for u in self.units:
            u.outer.copy_(u.local_flat())
            u.momentum.zero_()
        self.anchored = True

    @torch.no_grad()
    def _average_gradients(self) -> None:
        """Warm-up: the gradient shards (already averaged inside the replica) averaged over the
        replicas, so every rank takes the same synchronous step."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        grads = [local_piece(p.grad) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        flat = self.comm.all_reduce(flat, "outer", tag="grad").wait().div_(self.topo.replicas)
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()

    # -- a sync -------------------------------------------------------------------------------

    def _due(self, steps_done: int) -> bool:
        W, H = self.config.warmup_sync_steps, self.config.sync_every
        return (steps_done > W and (steps_done - W) % H == 0 and steps_done != self.last_prepared)

    def _prepare(self, steps_done: int, extra: list[float] | None = None,
                 skip=None) -> list[list[float]] | None:
        """Exchange every unit's pseudo-gradient norms (and `extra` numbers), decide the sync
        (edit_plan.py), start the first unit's exchange. Returns each replica's `extra`, or None
        where `skip(those extras)` called the sync off (nothing decided or exchanged)."""
        t = self.topo
        sq = torch.stack([(u.outer.to(self.device, non_blocking=True) - u.local_flat()).double().pow(2).sum()
                          for u in self.units])
        mine = torch.cat([sq, torch.tensor(extra or [], dtype=torch.float64, device=self.device)])
        rows = [r.cpu().tolist() for r in self.comm.all_gather(mine, "world", tag="norms").wait()]
        rows, replicas, shards = self.membership.over_groups(self._quorum_rows,
                                                             (rows, t.replicas, t.shards))
        if skip is not None and skip(extras_of(rows, len(self.units), replicas, shards)):
            return None
        self.plan = decide_sync(rows, [u.ewma for u in self.units], replicas, shards,
                                self.penalty, per_step=self.timed)
        self.n_summed = replicas  # the rows of the plan: whose weighted deltas are summed
        for u, d in zip(self.units, self.plan.decisions):
            u.ewma = d.ewma
        self.last_prepared = steps_done
        self.syncs += 1
        self.sync_info = {"step": steps_done}
        self.started = self.applied = 0
        self._start(0)
        return self.plan.extras

    def _start(self, j: int) -> None:
        u, d = self.units[j], self.plan.decisions[j]
        self.started = j + 1
        if d.all_flagged:
            return
        c = self.config
        w = d.weights[self.me] if self.me is not None else 0.0
        delta = (u.outer.to(self.device, non_blocking=True) - u.local_flat()).mul_(w)
        if c.codec != "fp32":  # encoded: the mean over the n_summed rows, times n_summed
            if u.residual is not None:  # error feedback, in the weighted units that are summed
                delta.add_(u.residual, alpha=c.outer_momentum if c.outer_rule == "sparseloco" else 1.0)
            avg = self.comm.average(delta, "outer", c.codec, exchange_block(c), tag=u.tag,
                                    exchange=c.exchange)
            if c.error_feedback:
                u.residual = delta - avg.sent
            u.pending = Summed(avg, self.n_summed)
        else:
            u.pending = self.membership.all_reduce(self.comm, delta, u.tag)

    def _hook(self, j: int, module, args) -> None:
        if self.plan is None:
            return
        if j + 1 < len(self.units):
            self._start_through(j + 1)  # the next unit's bytes travel while this one computes
        self._apply_through(j)

    def _start_through(self, j: int) -> None:
        while self.started <= j:
            self._start(self.started)

    def _apply_through(self, j: int) -> None:
        self._start_through(j)
        while self.plan is not None and self.applied <= j:
            self._apply(self.applied)

    def _drain(self) -> None:
        self._apply_through(len(self.units) - 1)

    @torch.no_grad()
    def _apply(self, j: int) -> None:
        c, t = self.config, self.topo
        u, d = self.units[j], self.plan.decisions[j]
        self.applied = j + 1
        avg_norm, scale = None, 1.0
        if not d.all_flagged:
            avg = u.pending.wait().to(self.device)
            u.pending = None
            if self.membership.failed():
                self._uncommitted(j)  # a peer died mid-sync: this unit keeps its state
                return
            if self.penalty.clip > 0:
                sq = avg.double().pow(2).sum().reshape(1)
                if t.shards > 1:
                    sq = self.comm.all_reduce(sq, "inner", tag="clip").wait()
                avg_norm = float(sq.sqrt())
                scale = clip_scale(self.penalty, avg_norm)
                if scale != 1.0:
                    avg.mul_(scale)
            if c.outer_rule == "sparseloco":  # the momentum is in the error feedback
                u.write(sgd_step(u.outer, avg, c.outer_lr))
            else:
                mu = outer_momentum_at(c, self.syncs - 1)  # (--outer-warmup: the k-th sync's)
                u.write(nesterov_step(u.outer, u.momentum, avg, c.outer_lr, mu))
        else:
            u.write(u.outer.to(self.device, non_blocking=True))
        if self.comm.events is not None:
            per_step = self.timed and self.penalty.mode == "lowband"  # reference: raw norms
            penalty = (event_fields(self.plan, j, self.me, per_step=per_step)
                       if self.me is not None else {"weight": 0.0, "healed": True})
            fields = dict(self.sync_info, block=u.name, **penalty, clip_scale=scale,
                          outer_lr=c.outer_lr)
            if avg_norm is not None:
                fields["avg_norm"] = avg_norm
            self.comm.events.emit("sync", **fields)
        self._left_out(j)
        self._applied_one()

    def _left_out(self, j: int) -> None:
        """A `guard` record and event for each replica left out of unit j's average."""
        d, members = self.plan.decisions[j], self.membership.members
        for i, why in left_out(self.plan, j, self.penalty).items():
            replica = members[i] if members and len(members) == len(d.flags) else i
            record = self.guard.note(self.sync_info["step"], self.units[j].name, replica, why,
                                     d.all_flagged)
            if self.comm.events is not None:
                self.comm.events.emit("guard", **record)

    def _applied_one(self) -> None:
        if self.applied == len(self.units):
            self.plan = None
            self.membership.commit()  # the sync's vote, once every unit is done

    # -- --elastic (docs/elastic.md) -----------------------------------------------------------

    def _quorum_rows(self, world: tuple) -> tuple[list[list[float]], int, int]:
        """The sync's rows over the quorum, from `world`'s (this group's ranks' rows, and R and
        S): this group's whole-unit squared norms (its shards' summed) and extras, gathered from
        every group, one row a group; a group healed in this quorum (a copy of its source) is
        left out and sends zeros (self.me None)."""
        rows, n = world[0], len(self.units)
        mine = [sum(r[j] for r in rows) for j in range(n)] + rows[0][n:]
        healed = float(self.membership.healed_now)
        t = torch.tensor(mine + [healed], dtype=torch.float64, device=self.device)
        every = [r.cpu().tolist() for r in self.membership.all_gather(self.comm, t, "norms").wait()]
        self.healed_in_quorum = [bool(r[-1]) for r in every]
        members = [i for i, r in enumerate(every) if not r[-1]]
        position = self.membership.position()
        self.me = members.index(position) if position in members else None
        return [every[i][:-1] for i in members], len(members), 1

    def _uncommitted(self, j: int) -> None:
        if self.comm.events is not None:
            self.comm.events.emit("skip", step=self.sync_info.get("step"), what="commit",
                                  block=self.units[j].name)
        self._applied_one()

    def join(self, step):
        self._quorum_at = step
        if self.membership.join(step):  # healed: the others are in the sync of healed_step,
            self._quorum_at = self.healed_step  # the trainer goes on there, and so does this group

    def healed(self) -> None:  # (a heal hands over each rank's shards: state_dict(), base.py)
        for u in self.units:
            u.residual = None  # error feedback is this group's own

    # -- outer parameters, evaluation, state --------------------------------------------------

    def outer_params(self) -> dict[str, torch.Tensor]:
        """The full outer parameters by name (each gathered over the inner group)."""
        self._reshard()
        names = {id(p): n for n, p in self.model.named_parameters()}
        return {names[id(p)]: t for u in self.units for p, t in zip(u.params, u.full_outer(self.device))}

    @contextlib.contextmanager
    def eval_weights(self, which: str):
        if which != "outer" or not self.anchored:  # in the warm-up the replicas are in step
            yield
            return
        self._reshard()
        saved = [u.local_flat().clone() for u in self.units]
        for u in self.units:
            u.write(u.outer.to(self.device))
        try:
            yield
        finally:
            self._reshard()
            for u, flat in zip(self.units, saved):
                u.write(flat)

    def state_dict(self) -> dict:
        """This rank's state: outer shards, momentum, statistics, counters; an exchange in
        flight is waited for and kept as landed."""
        units = []
        self._reshard()  # (the model's state beside it is the sharded one)
        settle(self.device)
        for u in self.units:
            if u.pending is not None and not isinstance(u.pending, Landed):
                u.pending = Landed(u.pending.wait())
            units.append({"outer": u.outer, "momentum": u.momentum, "ewma": u.ewma.state(),
                          "pending": None if u.pending is None else u.pending.value,
                          "residual": u.residual})
        plan = None if self.plan is None else plan_state(self.plan)
        return {"units": units, "plan": plan, "started": self.started, "applied": self.applied,
                "anchored": self.anchored, "steps_done": self.steps_done,
                "last_prepared": self.last_prepared, "syncs": self.syncs,
                "sync_info": dict(self.sync_info), "skips": getattr(self, "skips", 0)}

    def load_state_dict(self, state: dict) -> None:
        self._reshard()
        settle(self.device)
        for u, s in zip(self.units, state["units"]):
            u.outer.copy_(s["outer"])
            u.momentum.copy_(s["momentum"])
            u.ewma = stats_from_state(self.penalty, s["ewma"])
            u.pending = None if s["pending"] is None else Landed(s["pending"].to(self.device))
            u.residual = s.get("residual")
        self.plan = None if state["plan"] is None else plan_from_state(state["plan"])
        self.started, self.applied = state["started"], state["applied"]
        self.anchored, self.steps_done = state["anchored"], state["steps_done"]
        self.last_prepared, self.syncs = state["last_prepared"], state["syncs"]
        self.sync_info = dict(state["sync_info"])
        self.skips = state.get("skips", 0)
