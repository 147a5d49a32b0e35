"""The Hugging Face Trainer with lowband's diloco or streaming: `LowbandCallback`.

    from transformers import Trainer
    from lowband.integrations.transformers import LowbandCallback, LowbandTrainingArguments

    args = LowbandTrainingArguments(output_dir="out", max_steps=1000, learning_rate=3e-4,
                                    per_device_train_batch_size=8,
                                    eval_strategy="steps", eval_steps=100)
    callback = LowbandCallback("streaming", sync_every=20, codec="fp4-e3m0")
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=val,
                      callbacks=[callback])
    trainer.train()          # callback.summary: summary.json's figures, on rank 0

started by `lowband launch --script train.py --replicas 4` (or torchrun, a rank a replica group).
When training begins the callback wraps the Trainer's model and optimizer in a lowband.Sync
(sync/), with `lowband train`'s options by their Python names; after each optimizer step it
calls sync.step() with the step's loss and tokens, each evaluation's eval_loss becomes an eval
event, and the end of training ends the run (model.pt, outer.pt, summary.json).

- The step's loss is the mean of the model's output.loss over the step's micro-batches (their
  sum where the Trainer passes num_items_in_batch: each is then a share of the step's mean),
  read by a forward hook on the model while it trains.
- The step's tokens are the Trainer's own count (state.num_input_tokens_seen) where
  include_num_input_tokens_seen is on; otherwise the main input's (input_ids') elements in the
  step's training forward passes.
- The Trainer's logging, evaluation and saving between steps are left out of the step's time,
  as `lowband train` leaves out its own.
- Resume: checkpoint_every= equal to the Trainer's save_steps, and after a loss
  `LowbandCallback(..., resume=True)` with `trainer.train(resume_from_checkpoint=True)`: the
  Trainer restores its schedule, data position and rank 0's files, lowband's checkpoint every
  replica's own weights, inner optimizer and outer state (the learning rate stays the Trainer's
  schedule's). Both must continue from the same step, or the callback says so. The resumed run
  equals the one never lost, bitwise.

LowbandTrainingArguments (TrainingArguments, the same arguments): in a job of several processes
the Trainer (through accelerate) sees torchrun's variables and trains data-parallel over all of
them: DDP would average every step's gradients over every rank, so the replicas would no longer
train apart. These arguments set the Trainer's devices up as a job of this one process (accelerate
made to look with torchrun's variables hidden) on this rank's device, as lowband's own ranks pick
it. Each rank then samples the training set in its own order: its data_seed is the given one (or
the seed) plus its rank. The Trainer saves and logs on rank 0 only (process_index is the job's
rank), and writes each rank's RNG state into its checkpoints.

diloco and streaming (and any algorithm whose `user_loop` is AT_STEP_EDGES, algorithms/base.py)
with one rank a replica group run here: their hooks sit at the step's edges. ddp (IN_BACKWARD) and
shards > 1 average gradients inside the backward pass, which the Trainer runs, with its own
gradient clipping before any hook at the step's end: the callback refuses them, as it refuses
the algorithms that need lowband's own loop (OWN_LOOP).
"""

from __future__ import annotations

import contextlib
import os
from functools import cached_property

import torch

from lowband.options import needs_extra

needs_extra("hf", "lowband.integrations.transformers", "transformers", "accelerate")

from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from transformers import TrainerCallback, TrainingArguments  # noqa: E402

from lowband.config import ConfigError  # noqa: E402
from lowband.models import blocks_of  # noqa: E402
from lowband.integrations import (Framework, check_layout, check_options,  # noqa: E402
                                  job_rank, start_sync)
from lowband.sync import Sync  # noqa: E402
from lowband.sync.options import config_of  # noqa: E402
from lowband.comm.topology import pick_device  # noqa: E402

# torchrun's variables: with them accelerate makes a process one of a data-parallel job
JOB_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
# the Trainer, in the callback's refusals; the lowband options it takes from the Trainer's
# arguments, and where they are set there
TRAINER = Framework(
    who="the Trainer",
    backward="which the Trainer runs, with its own gradient clipping before any hook of the "
             "callback",
    ddp="use the Trainer's own DDP (torchrun without the callback)",
    owned={"steps": "the Trainer's max_steps (or num_train_epochs)",
           "batch_size": "the Trainer's per_device_train_batch_size",
           "grad_accum": "the Trainer's gradient_accumulation_steps"},
    place="in the TrainingArguments",
    resume="the Trainer's save_steps equal to checkpoint_every")


@contextlib.contextmanager
def _alone(device: torch.device):
    """The environment of a job of this one process on `device`: torchrun's variables hidden,
    accelerate's device named (ACCELERATE_TORCH_DEVICE); restored after."""
    hidden = {k: os.environ.pop(k) for k in JOB_VARIABLES if k in os.environ}
    before = os.environ.get("ACCELERATE_TORCH_DEVICE")
    os.environ["ACCELERATE_TORCH_DEVICE"] = str(device)
    try:
        yield
    finally:
        os.environ.update(hidden)
        if before is None:
            os.environ.pop("ACCELERATE_TORCH_DEVICE")
        else:
            os.environ["ACCELERATE_TORCH_DEVICE"] = before


class LowbandTrainingArguments(TrainingArguments):
    """TrainingArguments for one rank of a lowband job: the Trainer trains this rank's replica
    alone on this rank's device, in the rank's own data order (module doc). Not a dataclass of
    its own, so it combines with another TrainingArguments subclass:
    `class Args(LowbandTrainingArguments, SFTConfig)`."""

    def __post_init__(self):
        self.data_seed = (self.seed if self.data_seed is None else self.data_seed) + job_rank()
        super().__post_init__()

    @cached_property
    def _setup_devices(self) -> torch.device:
        device = pick_device("cpu" if self.use_cpu else "auto")  # as lowband's ranks pick it
        with _alone(device):
            found = TrainingArguments._setup_devices.func(self)
        if device.type == "cuda":  # (a single process takes cuda:0 and every visible GPU)
            torch.cuda.set_device(device)
            self._n_gpu = 1
            return device
        return found

    @property
    def process_index(self) -> int:
        """The job's rank: the Trainer saves and logs on rank 0, each rank its own RNG file."""
        return job_rank()

    @property
    def local_process_index(self) -> int:
        return job_rank("LOCAL_RANK")


class LowbandCallback(TrainerCallback):
    """A lowband.Sync around the Trainer's model and optimizer (module doc). algo: diloco or
    streaming; recipe, resume: as lowband.Sync's; options: `lowband train`'s by their Python
    names, but for steps, batch_size and grad_accum, which are the Trainer's. After training,
    `summary` holds summary.json's figures on rank 0 (None elsewhere)."""

    def __init__(self, algo: str = "streaming", *, recipe: str | None = None,
                 resume: bool = False, **options):
        check_options(TRAINER, algo, options)
        self.algo, self.recipe, self.resume, self.options = algo, recipe, resume, options
        self.sync: Sync | None = None
        self.summary: dict | None = None
        self._hook = None
        self._paused = contextlib.ExitStack()
        self._losses: list[torch.Tensor] = []
        self._shares = False  # the step's losses are shares of its mean (num_items_in_batch)
        self._tokens = 0  # main-input elements in this step's training forward passes
        self._seen = 0  # state.num_input_tokens_seen at the last step

    # -- the Trainer's events -------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        world = job_rank("WORLD_SIZE") or 1
        if world > 1 and not isinstance(args, LowbandTrainingArguments):
            raise ConfigError(f"in a job of {world} processes the Trainer's own TrainingArguments "
                              "would train data-parallel over all of them (DDP averaging every "
                              "step's gradients, so the replicas no longer train apart): make them "
                              "with lowband.integrations.transformers.LowbandTrainingArguments "
                              "(the same arguments).")
        blocks = blocks_of(model)
        sizes = dict(steps=state.max_steps, batch_size=args.per_device_train_batch_size,
                     grad_accum=args.gradient_accumulation_steps)
        cfg = config_of(self.algo, self.recipe, {**self.options, **sizes}, len(blocks))
        check_layout(TRAINER, cfg)
        if isinstance(optimizer, AcceleratedOptimizer):  # accelerate's wrapper: its optimizer
            optimizer = optimizer.optimizer
        self.sync = start_sync(TRAINER, model, optimizer, self.algo, step=state.global_step,
                               recipe=self.recipe, blocks=blocks, resume=self.resume,
                               options={**self.options, **sizes})
        self._hook = model.register_forward_hook(self._forward, with_kwargs=True)
        self._seen = state.num_input_tokens_seen
        if args.eval_on_start:  # the Trainer evaluates now: not training time
            self._paused.enter_context(self.sync.paused())

    def on_step_begin(self, args, state, control, **kwargs):
        self._paused.close()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.sync is None:
            return
        if self._losses:
            losses = torch.stack(self._losses).float()
            loss = float(losses.sum() if self._shares else losses.mean())
        else:
            loss = float("nan")  # the model returned no loss (the Trainer computed it)
        if args.include_num_input_tokens_seen != "no":
            seen = state.num_input_tokens_seen
            tokens, self._seen = seen - self._seen, seen
        else:
            tokens = self._tokens
        self._losses, self._shares, self._tokens = [], False, 0
        self.sync.step(loss=loss, tokens=tokens)

    def on_step_end(self, args, state, control, **kwargs):
        self._pause_for_trainer(control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._pause_for_trainer(control)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.sync is not None and not self.sync.finished and "eval_loss" in (metrics or {}):
            self.sync.evaluated(metrics["eval_loss"])

    def on_train_end(self, args, state, control, **kwargs):
        if self.sync is None or self.sync.finished:
            return
        self._paused.close()
        self._hook.remove()
        self.summary = self.sync.finish()

    # -- inside ---------------------------------------------------------------------------

    def _pause_for_trainer(self, control) -> None:
        """The Trainer's logging, evaluation and saving after a step: not training time."""
        if self.sync is not None and not self.sync.finished and (
                control.should_log or control.should_evaluate or control.should_save):
            self._paused.close()
            self._paused.enter_context(self.sync.paused())

    def _forward(self, module, args, kwargs, output) -> None:
        """A training forward pass: its loss and its main input's tokens, for the step."""
        if not module.training:
            return
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if torch.is_tensor(loss):
            self._losses.append(loss.detach())
            self._shares = self._shares or kwargs.get("num_items_in_batch") is not None
        ids = kwargs.get(getattr(module, "main_input_name", "input_ids"), args[0] if args else None)
        if torch.is_tensor(ids):
            self._tokens += ids.numel()


__all__ = ["LowbandCallback", "LowbandTrainingArguments"]
