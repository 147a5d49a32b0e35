"""The small interface the trainer calls. The trainer owns the loop; an algorithm adds hooks.

Per step the trainer calls, in order:
  before_forward(step)                       start or apply syncs (streaming, edit)
  for each micro-batch: forward, before_backward(step, micro, last), backward
  after_backward(step)                       gradient communication (ddp, acco)
  (gradient clipping, inner optimizer step)
  after_step(step)                           outer steps and merges (diloco family)
and finish() once after the last step, to drain transfers still in flight.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import torch
import torch.nn as nn

from typing import ClassVar

from lowband.comm import Comm
from lowband.params import local_piece, local_state, sharded_state
from lowband.schedule import lr_at
from lowband.comm.topology import Topology

# How an algorithm uses the slow outer link, read by the dashboard, the report and the planner:
EVERY_STEP = "every-step"  # traffic over the outer link every step (ddp, zero1, acco)
PERIODIC = "periodic"      # outer syncs every few steps or seconds (the diloco family, edit)

# How an algorithm fits a user's own loop (lowband.Sync, and the Hugging Face Trainer through it),
# read by both from its class's `user_loop`:
AT_STEP_EDGES = "step-edges"  # hooks only around the step (before forward, after the optimizer's
                              # step): any loop, the Trainer's too (diloco, streaming)
IN_BACKWARD = "backward"      # also inside the backward pass (ddp's buckets): a loop that calls
                              # sync.backward(loss); not the Trainer, which runs the backward itself
OWN_LOOP = "own-loop"         # lowband's own loop only; `own_loop_why` says why (zero1, acco, edit)


class Algorithm:
    """One registry line (algorithms/__init__.py) plus these class attributes make an algorithm:
    `name`, `kind` (EVERY_STEP or PERIODIC), `elastic` (whether it runs --elastic), `user_loop`
    (how it fits a user's own loop: AT_STEP_EDGES, IN_BACKWARD or OWN_LOOP), `options`
    (the option groups it reads, declared beside its code; Config inherits them all), `defaults`
    (values of its fields left None, or functions of the config giving them), `summary` (one
    line for --help and `lowband recipes`).

    Every run has a membership, comm.membership, and an algorithm calls it without asking
    whether the run is elastic: a plain run's FixedMembership (comm/membership/fixed.py: every
    group, no heal, every vote commits, Comm's own exchange) or with --elastic torchft's
    Membership (comm/membership/elastic.py), whose quorums an elastic algorithm takes (join()
    in join, begin() before each sync) and whose vote gates each outer update (commit()). Its
    state_dict() holds all of its own state, so that a group healed from a live peer gets it
    with the model and the inner optimizer (heal_state, below); subclasses inherit all that."""
    name = "base"
    kind: ClassVar[str] = EVERY_STEP
    elastic: ClassVar[bool] = False
    options: ClassVar[tuple] = ()
    defaults: ClassVar[dict] = {}
    summary: ClassVar[str] = ""
    # how it fits a user's own loop (above): AT_STEP_EDGES, IN_BACKWARD or OWN_LOOP, and why not
    user_loop: ClassVar[str] = OWN_LOOP
    own_loop_why: ClassVar[str] = ("it does not say how it fits a loop of yours (its class sets "
                                   "user_loop)")
    # which published loss figures apply at equal tokens, for the planner's time to a target
    # (plan/loss.py): "ddp" (ddp's own updates), "diloco" (the DiLoCo family), None (none)
    loss_fit: ClassVar[str | None] = None

    @classmethod
    def check(cls, cfg) -> None:
        """Checks of this algorithm's own beyond its option groups' (ConfigError)."""

    @classmethod
    def outer_link(cls, run):
        """What this algorithm sends over the outer link, for `lowband plan`: a
        comm.sends.Schedule read off run (a comm.sends.Run: the model's sizes, R, S, H, P, tau,
        the codec, the step time). None: not modeled (the planner says so); a subclass of a
        modeled algorithm inherits its schedule."""
        return None
    # An algorithm whose step is not the standard sequence above (acco: micro-batches keep
    # accumulating while its communication round is in flight) sets owns_step and implements
    # train_step(step, batches, lr) -> (loss, micro-batches used); the trainer then calls it
    # in place of train.standard_step.
    owns_step = False
    # `lowband train`'s injected faults (faults.py: --corrupt of what a replica sends); None in
    # a user's loop
    faults = None
    skips = 0  # consecutive updates skipped for NaN or inf; the trainer stops past --max-skips
    # --elastic: the inner step this replica group was healed to (a live peer's) at a quorum;
    # the trainer continues from there and clears it
    healed_step: int | None = None
    # the trainer's clock.RunClock: training seconds, and with --time-budget the budget's
    # elapsed fraction every rank agrees on (None outside the trainer)
    clock = None
    # this rank's compute so far as the loop records it (session.Session.stepped: each step's
    # seconds less the link's waits) and the steps it covers: what an algorithm that paces its
    # syncs by speed reads (algorithms/pace.py)
    compute_s = 0.0
    computed_steps = 0
    # syncs by wall-clock time (aedit): replicas run different step counts, so the algorithm
    # keeps --time-budget itself, at its syncs, and its own schedule position
    timed: ClassVar[bool] = False

    def setup(self, model: nn.Module, blocks: nn.ModuleList,
              make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
              topology: Topology, comm: Comm, config) -> torch.optim.Optimizer:
        """Wrap the model if needed and build the inner optimizer (after any sharding).
        `config` is the run's lowband.config.Config (this module sits below it)."""
        self.model, self.blocks, self.topo, self.comm, self.config = model, blocks, topology, comm, config
        self.optimizer = make_optimizer(model.parameters())
        return self.optimizer

    def before_forward(self, step: int) -> None:
        pass

    def before_backward(self, step: int, micro: int, last: bool) -> None:
        pass

    def after_backward(self, step: int) -> None:
        pass

    def after_step(self, step: int) -> None:
        pass

    def join(self, step: int) -> None:
        """Before the first step (`step` steps done: 0, or a resumed run's checkpoint) with
        --elastic: take part in the first quorum; a group behind the others heals there from
        a live peer (healed_step) and joins the sync in progress."""

    def quorum_progress(self, step: int) -> int:
        """--elastic: what this group has trained, `step` inner steps done, as a number every
        group in the same sync agrees on (comm/membership/elastic.py: torchft heals from the
        highest): the inner step."""
        return step

    def quorum_tiebreak(self) -> int:
        """--elastic: among groups that trained equally far, a number that differs when their
        synced state does (below comm/membership/elastic.py's TIEBREAK); torchft heals the lower
        from the higher, so two groups that committed different updates at the same step (a
        commit vote only some of them passed, or two quorums of one step around a Lighthouse
        restart) meet again as one. 0: no such record (the algorithm keeps none)."""
        return 0

    def should_stop(self, step: int) -> bool:
        """Consulted by the trainer before each step (`step` steps done): True ends the loop.
        A run is --steps long; aedit, whose replicas run different numbers of steps, decides."""
        return step >= self.config.steps

    def ends_after(self, step: int) -> bool:
        """Whether the run ends after `step` steps (its last evaluation and checkpoint), known
        without a message: after --steps by default; acco when its micro-batch budget is spent.
        (aedit decides its end at a sync, in should_stop: it writes no checkpoints.)"""
        return step == self.config.steps

    def run_step(self, s: int) -> int | None:
        """Where inner step s (1-based, just taken) stands on the run's schedule, when every
        replica stands there too: the step that names its evaluations and checkpoints. s;
        with --local-steps adaptive only the step after which a sync started (None between)."""
        return s

    def micro_batches(self) -> int:
        """The micro-batches this rank accumulates a step: --grad-accum (diloco and streaming:
        its replica's of --replica-accum, algorithms/pace.py)."""
        return self.config.grad_accum

    def lr_step(self, step: int) -> float:
        """Where step `step` (0-based) read the learning-rate schedule (schedule.lr_at): at its
        number; acco and aedit at their budgets' progress. The `step` events report this lr."""
        return step

    def lr(self, step: int) -> float:
        """The learning rate of step `step` (0-based): the schedule at lr_step(step) and, with
        --time-budget, at the budget's elapsed fraction that every rank agreed on."""
        return lr_at(self.config, self.lr_step(step),
                     None if self.clock is None else self.clock.fraction(step))

    def progress_steps(self, step: int) -> float:
        """How far the run is once step `step` (0-based) is taken, in steps of --steps (the
        progress bar): step + 1; acco and aedit count their budgets."""
        return step + 1

    def finish(self) -> None:
        pass

    def evaluated(self, step: int, val_loss: float) -> None:
        """After an evaluation every rank took at `step` (val_loss: the mean over replicas, the
        same on every rank): diloco and streaming may roll back (--rollback, algorithms/guard.py)."""

    def outer_params(self) -> dict[str, torch.Tensor] | None:
        """The outer (synced) parameters by name, for algorithms that keep them."""
        return None

    def eval_weights(self, which: str):
        """A context in which the model holds the weights to evaluate ('local' or 'outer')."""
        return contextlib.nullcontext()

    def state_dict(self) -> dict:
        """This rank's state beyond the model and the inner optimizer: what a checkpoint keeps
        beside them (checkpoint/, through torch DCP) and a heal hands over with them."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    # --elastic: what a live group hands a joining one through torchft's Manager (the trainer
    # registers the algorithm with comm.membership), each rank its own pieces of sharded tensors
    def heal_state(self) -> dict:
        state = self.state_dict()  # first: it drains and settles what is in flight
        return {"algorithm": state, "optimizer": local_state(self.optimizer.state_dict()),
                "model": {k: local_piece(v) for k, v in self.model.state_dict().items()}}

    @torch.no_grad()
    def load_heal_state(self, state: dict) -> None:
        self.load_state_dict(state["algorithm"])
        for k, v in self.model.state_dict().items():
            local_piece(v).copy_(state["model"][k])
        self.optimizer.load_state_dict(sharded_state(state["optimizer"], self.optimizer))
        self.healed()

    def healed(self) -> None:
        """After a heal: drop the peer's state that is a group's own (streaming and edit: the
        error feedback, what quantization left out of that group's own pseudo-gradients)."""
