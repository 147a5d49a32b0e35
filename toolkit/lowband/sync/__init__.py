"""lowband's algorithms inside your own training loop: `lowband.Sync(model, optimizer, algo=...)`.

    sync = lowband.Sync(model, optimizer, algo="streaming", sync_every=20, codec="fp4-e3m0")
    for step in sync.range():        # start_step .. steps, following an elastic heal
        loss = model_loss(model, batch(step))
        sync.backward(loss)          # or loss.backward() (diloco and streaming, one rank a group)
        optimizer.step()
        optimizer.zero_grad()
        sync.step(loss=loss, tokens=tokens_in(batch(step)))
    sync.finish(val_loss=...)

The options are `lowband train`'s, by the same names and with the same defaults (a recipe's
too); those of lowband's own loop (the model, data, learning rate and schedule, evaluation)
are the user's loop's and are refused here. The world comes from torchrun, `lowband launch
--script` or the environment; the run directory gets the events, config.json, checkpoints and
summary.json that `lowband train` writes, so the dashboard, `lowband report` and `lowband
compare` read the run. The hooks are the trainer's (algorithms/base.py), called in its order:
a step's set-up at the end of the step before (after its checkpoint), the backward hooks in
sync.backward, the outer work in sync.step, after the user's optimizer step.

ddp, diloco and streaming run here; zero1, acco, edit and aedit cannot (UNWRAPPABLE says why).

elastic=True (or `lowband launch --elastic --script`, whose groups' environment says so): each
replica group is a job of its own joined through torchft (docs/elastic.md). A restarted group
continues from its newest checkpoint and heals from a live peer in its first quorum (start_step
is then the peer's step); a group that falls behind later heals at a sync, inside sync.step(),
and goes on at the peer's step, which sync.range() yields next. A heal hands over `state`'s
objects with the model, the optimizer and the algorithm's state.
"""

from __future__ import annotations

import torch

from lowband.comm import topology as topo_mod
from lowband.algorithms import ALGORITHMS
from lowband import checkpoint
from lowband.checkpoint import lifecycle
from lowband.clock import RunClock
from lowband.comm.membership.elastic import replica_of_env
from lowband.config import ConfigError
from lowband.ledger import Ledger
from lowband.models import blocks_of
from lowband.sync.options import config_of
from lowband.telemetry import EventWriter
from lowband.train import (_checkpoint, _take_heal, record_eval, set_up, start_training,
                           write_results)

# the algorithms a wrapper around the user's optimizer cannot run, and why (docs/your-loop.md)
UNWRAPPABLE = {
    "zero1": "it shards the inner optimizer's state over a replica's ranks and builds that "
             "optimizer itself, so it cannot step the optimizer you made",
    "acco": "it owns the inner step (micro-batches keep accumulating while its round is in "
            "flight, then its own AdamW on flat shards), so it cannot follow your optimizer's step",
    "edit": "it shards the model with FSDP2 and builds the inner optimizer over the sharded "
            "parameters, so the optimizer you made would step parameters no longer trained",
    "aedit": "it shards the model as edit does, and its replicas sync by wall-clock time and "
             "decide the run's end among themselves, which your loop's length cannot follow",
}
WRAPPED = "_lowband_sync"  # the attribute that marks a model already wrapped


class Sync:
    """One run of a lowband algorithm around a user's model and inner optimizer (module doc).
    algo: ddp, diloco or streaming; recipe: a recipe's name (`lowband recipes`) whose values
    come first; blocks: the blocks lowband fragments (default: found as `lowband train` finds
    them); resume: continue run_dir from its newest checkpoint; state: the user's own objects
    with state_dict()/load_state_dict() (a scheduler, a data position) checkpointed beside the
    model; options: `lowband train`'s, by their Python names (sync_every=20)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 algo: str = "streaming", *, recipe: str | None = None, blocks=None,
                 resume: bool = False, state: dict | None = None, **options):
        if getattr(model, WRAPPED, None) is not None:
            raise ConfigError("this model is already wrapped by a lowband.Sync: wrap it once and "
                              "use that Sync for the whole run.")
        if algo in UNWRAPPABLE:
            raise ConfigError(f"lowband.Sync cannot run algo={algo!r}: {UNWRAPPABLE[algo]}; run "
                              f"it with `lowband train`, or pick ddp, diloco or streaming here.")
        _check_owner(model, optimizer)
        for key, obj in (state or {}).items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ConfigError(f"state[{key!r}] has no state_dict() and load_state_dict(), so "
                                  "it cannot be checkpointed: pass objects that have both.")
        self.blocks = blocks if blocks is not None else blocks_of(model)
        cfg = config_of(algo, recipe, options, len(self.blocks))
        self.config, self.model, self.optimizer, self.state = cfg, model, optimizer, state or {}
        device = next(model.parameters()).device
        topo = topo_mod.init(cfg.replicas, cfg.shards, device.type, cfg.backend,
                             replica=replica_of_env() if cfg.elastic else None)
        if topo.device.type != device.type:
            raise ConfigError(f"the model is on {device.type} but this rank trains on "
                              f"{topo.device.type}: move it there (or pass device=) first.")
        start = lifecycle.begin(cfg, topo, resume)
        self.topo, self.run = topo, start.run
        self.events = EventWriter(start.run, topo.rank, topo.replica)
        self.comm, self.algo, inner = set_up(cfg, topo, start.run, self.events, model, self.blocks,
                                             lambda params: optimizer, True, {"loop": "lowband.Sync"})
        if inner is not optimizer:  # (not for the algorithms above; a registered one may)
            raise ConfigError(f"algo={algo!r} builds its own inner optimizer, so it cannot step "
                              "yours: run it with `lowband train`.")
        if self.state:  # an elastic heal hands them over too
            self.comm.membership.hand_over(
                "user", lambda got: checkpoint.load_user_state(self.state, got),
                lambda: checkpoint.user_state(self.state))
        setattr(model, WRAPPED, self)
        self.ledger = Ledger(topo.shards, cfg.elastic)
        self.done = start_training(cfg, topo, self.events, model, optimizer, self.algo, self.comm,
                                   start.resume_from, start.attempt, self.state)
        self.clock = self.algo.clock = RunClock(None, self.done.wall_s, topo.device)
        self._stepped = 0  # the optimizer's steps since the last sync.step()
        self._hook = optimizer.register_step_post_hook(self._optimizer_stepped)
        self._backward_needed = cfg.algo == "ddp" or cfg.shards > 1  # gradients averaged in it
        self._backward_done = False
        self._micro = 0
        self.finished = False
        self._begin_step()

    # -- what the user's loop calls --------------------------------------------------------

    @property
    def start_step(self) -> int:
        """The steps already done: 0, or a resumed run's (a healed group's) step."""
        return self.done.step

    @property
    def steps(self) -> int:
        """The run's length (steps=, as `lowband train --steps`)."""
        return self.config.steps

    def range(self):
        """The steps to train, each the step this Sync is at: `for step in sync.range():`, from
        start_step to steps. It follows a heal (elastic: a group behind the others goes on from a
        live peer's state and step), which range(sync.start_step, sync.steps) would not."""
        while self.done.step < self.config.steps and not self.finished:
            step = self.done.step
            yield step
            if self.done.step == step and not self.finished:
                raise ConfigError(f"sync.range() went past step {step + 1} without sync.step(): "
                                  "call it once a step, after the optimizer's step.")

    def backward(self, loss: torch.Tensor, last: bool = True) -> None:
        """loss.backward() with the algorithm's hooks around it: ddp's gradient buckets leave
        during it and are averaged at its end. last: the step's last micro-batch (with gradient
        accumulation, False on the others: their gradients only accumulate)."""
        self._check_open()
        step = self.done.step
        self.algo.before_backward(step, self._micro, last)
        loss.backward()
        self._micro += 1
        if last:
            self.algo.after_backward(step)
            self._backward_done = True

    def step(self, loss: float | torch.Tensor | None = None, tokens: int | None = None,
             val_loss: float | None = None) -> None:
        """After the optimizer's step: the algorithm's outer work (syncs, merges), the step's
        event (loss: this rank's training loss; tokens: this rank's tokens this step, default
        batch_size x seq_len x grad_accum), an evaluation's event when val_loss is given, a
        checkpoint when checkpoint_every says so, and the next step's set-up."""
        self._check_open()
        step = self.done.step
        if self._stepped == 0 and not self._counted:
            raise ConfigError("sync.step() was called before the optimizer's step: call "
                              "optimizer.step() first, then sync.step(), once a step.")
        if self._backward_needed and not self._backward_done:
            raise ConfigError(f"algo={self.config.algo!r} with shards={self.config.shards} "
                              "averages gradients in sync.backward(loss): call it in place of "
                              "loss.backward(), before the optimizer's step.")
        if step >= self.config.steps:
            raise ConfigError(f"step {step + 1} is past steps={self.config.steps} given to "
                              "lowband.Sync: pass your loop's length as steps=.")
        self.algo.after_step(step)
        step_s = self.clock.seconds() - self._t0
        compute_s = max(step_s - self.comm.take_wait_s(), 0.0)
        c = self.config
        loss = float(loss.detach().float().mean()) if torch.is_tensor(loss) else \
            float("nan") if loss is None else float(loss)
        self.done.advance(loss, c.grad_accum * c.batch_size * c.seq_len if tokens is None
                          else int(tokens), compute_s)
        _take_heal(self.algo, self.done)
        elapsed = self.clock.seconds()
        self.events.emit("step", step=step + 1, loss=loss, lr=self.optimizer.param_groups[0]["lr"],
                         tokens=self.done.tokens, step_s=step_s, compute_s=compute_s,
                         elapsed_s=elapsed)
        with self.clock.paused():
            if val_loss is not None:
                self._evaluated(float(val_loss), elapsed, everyone=True)
            if c.checkpoint_every and ((step + 1) % c.checkpoint_every == 0 or step + 1 == c.steps):
                self.checkpoint()
        self._stepped, self._counted = 0, True
        self._begin_step()

    def evaluated(self, val_loss: float) -> None:
        """An evaluation taken after this step's sync.step() (where a framework's loop, the
        Hugging Face Trainer's, evaluates): its event at the steps done, as step(val_loss=)
        writes it. Every rank calls it at the same step."""
        self._check_open()
        self._evaluated(float(val_loss), self.clock.seconds(), everyone=True)

    def paused(self):
        """A context for time that is not training (your evaluation, your logging): left out of
        the step's time, as `lowband train` leaves out its own."""
        return self.clock.paused()

    def checkpoint(self) -> None:
        """Write a checkpoint now (every rank calls it after the same step): the model, the
        optimizer, the algorithm's state and `state`'s objects, through torch DCP."""
        _checkpoint(self.run, self.events, self.model, self.optimizer, self.algo, self.topo,
                    self.comm, self.config, self.done, self.clock.seconds(), None, self.state)

    def finish(self, val_loss: float | None = None) -> dict | None:
        """End the run (every rank): exchanges in flight land, the final evaluation's event
        (val_loss, when given), model.pt and outer.pt, summary.json. Returns the summary on
        rank 0 (None elsewhere and with elastic)."""
        self._check_open()
        self.algo.finish()
        self.done.wall_s = self.clock.seconds()
        if val_loss is not None:
            self._evaluated(float(val_loss), self.done.wall_s, everyone=True)
        self.finished = True
        try:
            return write_results(self.config, self.topo, self.run, self.events, self.model,
                                 self.algo, self.comm, self.done, None)
        finally:
            self._release()

    def __enter__(self) -> "Sync":
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None and not self.finished:
            self.finish()
        elif not self.finished:  # a crash keeps its events and checkpoints, nothing more
            self._release()

    def _release(self) -> None:
        """The event files closed, the model and optimizer free for another Sync."""
        self.events.close()
        self._hook.remove()
        setattr(self.model, WRAPPED, None)

    # -- inside ----------------------------------------------------------------------------

    _counted = False  # whether a sync.step() was taken by this process

    def _optimizer_stepped(self, optimizer, args, kwargs) -> None:
        self._stepped += 1

    def _begin_step(self) -> None:
        """The set-up of the next step, as the trainer does it before the step reads its data:
        elastic ddp's quorum (should_stop), a heal, the syncs that start or land before the
        forward pass."""
        self._t0 = self.clock.seconds()  # training seconds: sync.paused() is left out
        step = self.done.step
        if step < self.config.steps:
            self.algo.should_stop(step)
            _take_heal(self.algo, self.done)
            self.algo.before_forward(self.done.step)
        self._backward_done, self._micro = False, 0

    def _evaluated(self, val_loss: float, elapsed: float, everyone: bool) -> None:
        record_eval(self.events, self.ledger, self.done, self.done.step, val_loss, elapsed,
                    self.comm.totals.wire_bytes["outer"], everyone)

    def _check_open(self) -> None:
        if self.finished:
            raise ConfigError("this lowband.Sync has finished its run: make a new one (with "
                              "resume=True to continue it).")


def _check_owner(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer steps exactly the model's trainable parameters."""
    mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
    names = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in mine]
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    if names:
        raise ConfigError(f"the optimizer does not own {len(names)} of the model's "
                          f"{len(trainable)} trainable parameters (the first: {names[0]}): build "
                          "it from model.parameters() of the model you wrap.")
    if mine - trainable:
        raise ConfigError(f"the optimizer steps {len(mine - trainable)} tensors that are not the "
                          "model's trainable parameters: build it from model.parameters() of the "
                          "model you wrap.")


__all__ = ["Sync", "UNWRAPPABLE"]
