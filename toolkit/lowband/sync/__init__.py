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

An algorithm says how it fits your loop (its class's `user_loop`, algorithms/base.py): ddp,
diloco and streaming run here; zero1, acco, edit and aedit cannot (their `own_loop_why` says
why); a registered subclass of one of them inherits its answer. The run itself (the run
directory, events, checkpoints, heals, the summary) is a session.Session, which `lowband train`
drives too: Sync only maps your loop's calls onto it.

elastic=True (or `lowband launch --elastic --script`, whose groups' environment says so): each
replica group is a job of its own joined through torchft (docs/elastic.md). A restarted group
continues from its newest checkpoint and heals from a live peer in its first quorum (start_step
is then the peer's step); a group that falls behind later heals at a sync, inside sync.step(),
and goes on at the peer's step, which sync.range() yields next. A heal hands over `state`'s
objects with the model, the optimizer and the algorithm's state.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from lowband.algorithms import ALGORITHMS
from lowband.algorithms.base import IN_BACKWARD, OWN_LOOP
from lowband.comm import topology as topo_mod
from lowband.comm.membership.elastic import replica_of_env
from lowband.config import ConfigError
from lowband.models import blocks_of
from lowband.options import UserError
from lowband.session import Session
from lowband.sync.options import config_of, loop_only
from lowband.telemetry import to_make, unmake

WRAPPED = "_lowband_sync"  # the attribute that marks a model already wrapped


def fitting(refused: tuple[str, ...] = ()) -> list[str]:
    """The algorithms that fit a user's loop (their `user_loop`), but for the ways `refused`."""
    return [name for name, a in ALGORITHMS.items()
            if a.user_loop != OWN_LOOP and a.user_loop not in refused]


def check_fits(algo: str, where: str, refused: dict[str, str] | None = None) -> None:
    """One sentence when `algo` (a registered name) cannot run in a user's loop at `where`:
    it needs lowband's own loop (its own_loop_why), or it fits in a way `where` refuses
    (refused: user_loop -> why not, and what to do instead)."""
    cls, refused = ALGORITHMS[algo], refused or {}
    others = either(fitting(tuple(refused)))
    if cls.user_loop in refused:
        raise ConfigError(f"{where} cannot run algo={algo!r}: {refused[cls.user_loop]}, or "
                          f"{others} here.")
    if cls.user_loop == OWN_LOOP:
        raise ConfigError(f"{where} cannot run algo={algo!r}: {cls.own_loop_why}; run it with "
                          f"`lowband train`, or pick {others} here.")


def either(names: list[str]) -> str:
    """'a, b or c'."""
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else "".join(names)


class Sync:
    """One run of a lowband algorithm around a user's model and inner optimizer (module doc).
    algo: one that fits your loop (ddp, diloco, streaming, or a registered one whose user_loop
    says so); recipe: a recipe's name (`lowband recipes`) whose values come first; blocks: the
    blocks lowband fragments (default: found as `lowband train` finds them); resume: continue
    run_dir from its newest checkpoint; state: the user's own objects with
    state_dict()/load_state_dict() (a scheduler, a data position) checkpointed beside the
    model; options: `lowband train`'s, by their Python names (sync_every=20)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 algo: str = "streaming", *, recipe: str | None = None, blocks=None,
                 resume: bool = False, state: dict | None = None, **options):
        if getattr(model, WRAPPED, None) is not None:
            raise ConfigError("this model is already wrapped by a lowband.Sync: wrap it once and "
                              "use that Sync for the whole run.")
        if algo in ALGORITHMS:  # (an unknown name: the config's sentence, below)
            check_fits(algo, "lowband.Sync")
        _check_owner(model, optimizer)
        for key, obj in (state or {}).items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ConfigError(f"state[{key!r}] has no state_dict() and load_state_dict(), so "
                                  "it cannot be checkpointed: pass objects that have both.")
        self.blocks = blocks if blocks is not None else blocks_of(model)
        cfg = config_of(algo, recipe, options, len(self.blocks))
        check_fits(cfg.algo, "lowband.Sync")
        self.config, self.model, self.optimizer, self.state = cfg, model, optimizer, state or {}
        device = next(model.parameters()).device
        topo = topo_mod.init(cfg.replicas, cfg.shards, device.type, cfg.backend,
                             replica=replica_of_env() if cfg.elastic else None)
        if topo.device.type != device.type:
            raise ConfigError(f"the model is on {device.type} but this rank trains on "
                              f"{topo.device.type}: move it there (or pass device=) first.")
        # rank 0: the directories making the run directory creates, which a refusal removes
        made = None if dist.get_rank() else to_make(Path(cfg.run_dir or "runs"))
        named = bool(cfg.run_dir)
        self.session = session = Session(cfg, topo, resume, user_state=self.state)
        self._made = made if made is None or named else [session.run.root, *made]
        try:
            inner = session.set_up(model, self.blocks, lambda params: optimizer, broadcast=True,
                                   meta={"loop": "lowband.Sync",
                                         "your_loop": sorted(loop_only())})
            if inner is not optimizer:  # (not for the algorithms above; a registered one may)
                raise ConfigError(f"algo={algo!r} builds its own inner optimizer, so it cannot "
                                  "step yours: run it with `lowband train`.")
            self.algo = session.algo
            setattr(model, WRAPPED, self)
            session.begin()
        except UserError:
            self._discard()
            raise
        self._stepped = 0  # the optimizer's steps since the last sync.step()
        self._backward_ran = False  # a gradient arrived since the last sync.step()
        self._hooks = [optimizer.register_step_post_hook(self._optimizer_stepped), *(
            p.register_post_accumulate_grad_hook(self._gradient_arrived)
            for p in model.parameters() if p.requires_grad)]
        # gradients averaged in the backward pass: ddp's buckets, a replica's shards
        self._backward_needed = self.algo.user_loop == IN_BACKWARD or cfg.shards > 1
        self._backward_done = False
        self._micro = 0
        self.finished = False
        self._begin_step()

    # -- what the user's loop calls --------------------------------------------------------

    @property
    def done(self):
        """The progress so far (session.Progress: steps, tokens, seconds, losses)."""
        return self.session.progress

    @property
    def topo(self):
        return self.session.topo

    @property
    def run(self):
        """The run directory (telemetry.RunDir)."""
        return self.session.run

    @property
    def start_step(self) -> int:
        """The steps already done: 0, or a resumed run's (a healed group's) step."""
        return self.done.step

    @property
    def schedule_step(self) -> float:
        """Where the step this Sync is at stands on the run's schedule, for your learning rate:
        the step itself, or with local_steps="adaptive" (a slower replica runs fewer steps
        between syncs) the run's step, which a slow replica's steps cross faster."""
        return self.algo.lr_step(self.done.step)

    @property
    def steps(self) -> int:
        """The run's length (steps=, as `lowband train --steps`)."""
        return self.config.steps

    def range(self):
        """The steps to train, each the step this Sync is at: `for step in sync.range():`, from
        start_step to steps. It follows a heal (elastic: a group behind the others goes on from a
        live peer's state and step), which range(sync.start_step, sync.steps) would not, and
        with local_steps="adaptive" it ends this replica's steps at the run's last sync (a
        slower replica runs fewer)."""
        while self.done.step < self.config.steps and not self._over and not self.finished:
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
            raise self._refused("sync.step() was called before the optimizer's step: call "
                                "optimizer.step() first, then sync.step(), once a step.")
        if self._stepped == 0 and not self._backward_ran:  # (a step AMP skipped had one)
            raise ConfigError(f"sync.step() was called twice in step {step}, with no backward "
                              "pass nor optimizer step since the first call: call it once a "
                              "step, after the optimizer's step (with val_loss= for that "
                              "step's evaluation, or sync.evaluated(val_loss) after it).")
        if self._backward_needed and not self._backward_done:
            raise self._refused(f"algo={self.config.algo!r} with shards={self.config.shards} "
                                "averages gradients in sync.backward(loss): call it in place "
                                "of loss.backward(), before the optimizer's step.")
        if step >= self.config.steps:
            raise ConfigError(f"step {step + 1} is past steps={self.config.steps} given to "
                              "lowband.Sync: pass your loop's length as steps=.")
        if self._over:
            raise ConfigError(f"step {step + 1} is past this replica's last sync (with "
                              "local_steps='adaptive' a slower replica runs fewer steps): loop "
                              "with `for step in sync.range()`.")
        self.algo.after_step(step)
        session, c = self.session, self.config
        loss = float(loss.detach().float().mean()) if torch.is_tensor(loss) else \
            float("nan") if loss is None else float(loss)
        elapsed = session.stepped(
            loss, c.grad_accum * c.batch_size * c.seq_len if tokens is None else int(tokens),
            session.clock.seconds() - self._t0, self.optimizer.param_groups[0]["lr"])
        with session.clock.paused():
            if val_loss is not None:
                session.evaluated(float(val_loss), elapsed)
            session.maybe_checkpoint(step + 1, self.algo.ends_after(step + 1))
        self._stepped, self._counted, self._backward_ran = 0, True, False
        self._begin_step()

    def evaluated(self, val_loss: float) -> None:
        """An evaluation taken after this step's sync.step() (where a framework's loop, the
        Hugging Face Trainer's, evaluates): its event at the steps done, as step(val_loss=)
        writes it. Every rank calls it at the same step."""
        self._check_open()
        self.session.evaluated(float(val_loss))

    def paused(self):
        """A context for time that is not training (your evaluation, your logging): left out of
        the step's time, as `lowband train` leaves out its own."""
        return self.session.clock.paused()

    def checkpoint(self) -> None:
        """Write a checkpoint now (every rank calls it after the same step): the model, the
        optimizer, the algorithm's state and `state`'s objects, through torch DCP."""
        self.session.checkpoint()

    def finish(self, val_loss: float | None = None) -> dict | None:
        """End the run (every rank): exchanges in flight land, the final evaluation's event
        (val_loss, when given), model.pt and outer.pt, summary.json. Returns the summary on
        rank 0 (None elsewhere and with elastic)."""
        self._check_open()
        self.finished = True
        try:
            return self.session.finish(None if val_loss is None else lambda: float(val_loss))
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
        self.session.close()
        for hook in self._hooks:
            hook.remove()
        setattr(self.model, WRAPPED, None)

    def _refused(self, why: str) -> ConfigError:
        """The refusal of a call; at the first step, whose run has nothing to keep, the run
        is discarded first (_discard): refused input leaves no run directory."""
        if not self._counted:
            self.finished = True
            self._discard()
        return ConfigError(why)

    def _discard(self) -> None:
        """A run refused before its first step leaves nothing: the model free again, and on
        rank 0 what the run wrote (RunDir.clear) and the directories made for it, while empty,
        removed. A run that trained (a resumed one) is kept as it is."""
        self._release()
        if self._made is not None:
            unmake(self.session.run, self._made)

    # -- inside ----------------------------------------------------------------------------

    _counted = False  # whether a sync.step() was taken by this process

    _hooks: tuple = ()  # the optimizer's step hook, then each parameter's gradient hook

    def _optimizer_stepped(self, optimizer, args, kwargs) -> None:
        self._stepped += 1

    def _gradient_arrived(self, param) -> None:
        self._backward_ran = True

    def _begin_step(self) -> None:
        """The set-up of the next step, as the trainer does it before the step reads its data:
        elastic ddp's quorum (should_stop), a heal, the syncs that start or land before the
        forward pass."""
        self._t0 = self.session.clock.seconds()  # training seconds: sync.paused() left out
        step = self.done.step
        self._over = step >= self.config.steps or self.algo.should_stop(step)
        if not self._over:
            self.session.take_heal()
            self.algo.before_forward(self.done.step)
        self._backward_done, self._micro = False, 0

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


__all__ = ["Sync", "check_fits", "either", "fitting"]
