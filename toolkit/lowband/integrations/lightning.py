"""PyTorch Lightning with lowband's diloco or streaming: `LowbandCallback`, `LowbandStrategy`.

    import lightning.pytorch as pl
    from lowband.integrations.lightning import LowbandCallback, LowbandStrategy

    callback = LowbandCallback("streaming", sync_every=20, codec="fp4-e3m0")
    trainer = pl.Trainer(strategy=LowbandStrategy(), max_steps=1000, callbacks=[callback])
    trainer.fit(module, train_loader, val_loader)   # callback.summary: summary.json's, rank 0

started by `lowband launch --script train.py --replicas 4` (or torchrun, a rank a replica group).
When training starts (on_train_start: the module on its device, its optimizer made, a resumed
fit's state restored) the callback wraps the LightningModule and its optimizer in a lowband.Sync
(sync/), with `lowband train`'s options by their Python names; at the end of each batch whose
optimizer stepped (on_train_batch_end, after Lightning's scheduler step) it calls sync.step()
with the step's loss and tokens; each validation's `monitor` metric (val_loss) becomes an eval
event; the end of fit ends the run (model.pt, outer.pt, summary.json).

- The step's loss is training_step's loss summed over the step's batches (Lightning divides each
  by accumulate_grad_batches: their sum is the step's mean).
- The step's tokens are the elements of each batch's main input: a dict's input_ids, a tuple's
  first tensor, or the batch itself.
- Lightning's work between steps (validation, checkpoints, logging, fetching the next batch) is
  left out of the step's time, as `lowband train` leaves out its own.
- Resume: lowband's checkpoint_every= and a Lightning checkpoint at the same steps
  (ModelCheckpoint(every_n_train_steps=N)); after a loss `LowbandCallback(..., resume=True)`
  with `trainer.fit(..., ckpt_path=...)`: Lightning restores its loop, step and schedule (rank 0's
  file), lowband's checkpoint every replica's own weights, inner optimizer and outer state (the
  learning rate stays Lightning's schedule's). Both continue from the same step, or the callback
  says so. Lightning resumes mid-epoch only with a resumable DataLoader (state_dict); from a step
  at an epoch's end, or with one, the resumed run equals the one never lost, bitwise.

LowbandStrategy (a SingleDeviceStrategy): under torchrun Lightning's own strategies are data-
parallel over the job (DDP averaging every step's gradients, so the replicas would no longer
train apart), and its single-device one makes every rank rank 0 (all of them writing the same
checkpoints). LowbandStrategy trains this rank's replica alone on its device (cuda:LOCAL_RANK,
as lowband's ranks pick it, or the CPU), rank 0 alone saving checkpoints; the training DataLoader
gets a DistributedSampler over the replicas, as Lightning's DDP gives it (each replica its share
of the data, Lightning's seed; Trainer(use_distributed_sampler=False) leaves it alone), while each
replica validates on the whole validation set.

diloco and streaming (and any algorithm whose `user_loop` is AT_STEP_EDGES, algorithms/base.py)
with one rank a replica group run here: their hooks sit at the step's edges. ddp (IN_BACKWARD) and
shards > 1 average gradients inside the backward pass, which Lightning runs; zero1, acco, edit
and aedit need lowband's own loop (OWN_LOOP); Lightning's data-parallel strategies (DDP, FSDP,
DeepSpeed: also what devices > 1 or num_nodes > 1 choose) would average every step's gradients;
manual optimization steps the optimizer inside training_step: each is refused in one sentence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch

from lowband.options import needs_extra

needs_extra("lightning", "lowband.integrations.lightning", "lightning")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator  # noqa: E402
from lightning.pytorch.strategies import SingleDeviceStrategy  # noqa: E402
from lightning.pytorch.trainer.connectors.data_connector import (  # noqa: E402
    _get_distributed_sampler)
from lightning.pytorch.trainer.states import RunningStage  # noqa: E402
from lightning.pytorch.utilities.data import _update_dataloader, has_iterable_dataset  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from lowband.comm.topology import pick_device  # noqa: E402
from lowband.config import ConfigError  # noqa: E402
from lowband.integrations import (Framework, check_layout, check_options,  # noqa: E402
                                  job_rank, start_sync)
from lowband.models import blocks_of  # noqa: E402
from lowband.sync import Sync  # noqa: E402
from lowband.sync.options import config_of  # noqa: E402

# Lightning, in the callback's refusals; the lowband options it takes from Lightning, and where
# they are set there
LIGHTNING = Framework(
    who="Lightning",
    backward="which Lightning runs",
    ddp="use Lightning's own strategy='ddp' (without the callback)",
    owned={"steps": "Lightning's max_steps (or max_epochs)",
           "batch_size": "the DataLoader's batch_size",
           "grad_accum": "Lightning's accumulate_grad_batches"},
    place="there",
    resume="a Lightning checkpoint every checkpoint_every steps: "
           "ModelCheckpoint(every_n_train_steps=checkpoint_every)")
USE_OURS = "pass Trainer(strategy=lowband.integrations.lightning.LowbandStrategy())"


class LowbandStrategy(SingleDeviceStrategy):
    """Lightning's strategy for one rank of a lowband job: this rank's replica alone on its
    device, rank 0 alone saving, the training data shared out over the replicas (module doc).
    Lightning's devices and num_nodes play no part: the job's processes are the launch's."""

    def __init__(self, **kwargs):
        super().__init__(device="cpu", **kwargs)  # (the device: root_device, below)
        self.global_rank, self.local_rank = job_rank(), job_rank("LOCAL_RANK")
        self.replicas = job_rank("WORLD_SIZE") or 1  # (shards > 1 is refused by the callback)

    @property
    def root_device(self) -> torch.device:
        """cuda:LOCAL_RANK under Lightning's CUDA accelerator, as lowband's ranks pick it; the
        CPU under its CPU one."""
        if isinstance(self.accelerator, CUDAAccelerator):
            return pick_device("cuda")
        if self.accelerator is None or isinstance(self.accelerator, CPUAccelerator):
            return torch.device("cpu")
        raise ConfigError(f"LowbandStrategy trains on CUDA or the CPU, not Lightning's "
                          f"{type(self.accelerator).__name__}: pass accelerator='cuda' or 'cpu'.")

    @property
    def is_global_zero(self) -> bool:
        """The job's rank 0: it alone writes Lightning's checkpoints."""
        return self.global_rank == 0

    def process_dataloader(self, dataloader):
        """The training DataLoader with a DistributedSampler over the replicas (Lightning's own,
        as its DDP injects it), unless it has one, is iterable, or the Trainer says not to."""
        trainer = self.lightning_module.trainer
        if (trainer.training and self.replicas > 1 and isinstance(dataloader, DataLoader)
                and trainer._accelerator_connector.use_distributed_sampler
                and not isinstance(dataloader.sampler, DistributedSampler)
                and not has_iterable_dataset(dataloader)):
            sampler = _get_distributed_sampler(dataloader, shuffle=True,
                                               overfit_batches=trainer.overfit_batches,
                                               num_replicas=self.replicas, rank=self.global_rank)
            dataloader = _update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING)
        return super().process_dataloader(dataloader)


class LowbandCallback(pl.Callback):
    """A lowband.Sync around the LightningModule and its optimizer (module doc). algo: diloco or
    streaming; recipe, resume: as lowband.Sync's; monitor: the logged metric whose value after
    each validation becomes an eval event; options: `lowband train`'s by their Python names, but
    for steps, batch_size and grad_accum, which are Lightning's. After fit, `summary` holds
    summary.json's figures on rank 0 (None elsewhere)."""

    def __init__(self, algo: str = "streaming", *, recipe: str | None = None,
                 resume: bool = False, monitor: str = "val_loss", **options):
        check_options(LIGHTNING, algo, options)
        self.algo, self.recipe, self.resume, self.options = algo, recipe, resume, options
        self.monitor = monitor
        self.sync: Sync | None = None
        self.summary: dict | None = None
        self._paused = contextlib.ExitStack()
        self._losses: list[torch.Tensor] = []
        self._tokens = 0  # main-input elements in this step's batches
        self._step = 0  # Lightning's global_step at the last sync.step()

    # -- Lightning's hooks ------------------------------------------------------------------

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        if not isinstance(strategy, SingleDeviceStrategy):
            raise ConfigError(f"Lightning's {type(strategy).__name__} would train data-parallel "
                              "over its devices and nodes (averaging every step's gradients, so "
                              "the replicas would no longer train apart): let lowband launch or "
                              f"torchrun start one process a replica and {USE_OURS}.")
        world = job_rank("WORLD_SIZE") or 1
        if world > 1 and not isinstance(strategy, LowbandStrategy):
            raise ConfigError(f"in a job of {world} processes Lightning's {type(strategy).__name__}"
                              " makes every rank rank 0 (each writing the same checkpoints, all "
                              f"on the same batches): {USE_OURS}.")
        if not pl_module.automatic_optimization:
            raise ConfigError("LowbandCallback runs Lightning's automatic optimization: with "
                              "automatic_optimization=False your training_step steps the "
                              "optimizer, so wrap it in lowband.Sync there yourself (sync.step() "
                              "after each optimizer step).")

    def on_train_start(self, trainer, pl_module) -> None:
        steps = trainer.estimated_stepping_batches  # max_steps, or max_epochs' steps
        if steps == float("inf"):
            raise ConfigError("LowbandCallback needs the run's length, which Lightning cannot "
                              "count with an endless DataLoader: set Trainer(max_steps=...).")
        blocks = blocks_of(pl_module)
        sizes = dict(steps=int(steps), grad_accum=trainer.accumulate_grad_batches)
        batch_size = getattr(trainer.train_dataloader, "batch_size", None)
        if isinstance(batch_size, int):  # (None with a batch_sampler: tokens are counted)
            sizes["batch_size"] = batch_size
        cfg = config_of(self.algo, self.recipe, {**self.options, **sizes}, len(blocks))
        check_layout(LIGHTNING, cfg)
        self.sync = start_sync(LIGHTNING, pl_module, trainer.optimizers[0], self.algo,
                               step=trainer.global_step, recipe=self.recipe, blocks=blocks,
                               resume=self.resume, options={**self.options, **sizes})
        self._step = trainer.global_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._paused.close()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.sync is None or self.sync.finished:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if torch.is_tensor(loss):
            self._losses.append(loss.detach())
        main = _main_input(batch)
        self._tokens += main.numel() if main is not None else 0
        if trainer.global_step == self._step:  # accumulating: the optimizer has not stepped
            return
        self._step = trainer.global_step
        # the model returned no loss: nan, as lowband.Sync records it
        loss = float(torch.stack(self._losses).float().sum()) if self._losses else float("nan")
        tokens, self._losses, self._tokens = self._tokens, [], 0
        self.sync.step(loss=loss, tokens=tokens)
        self._paused.enter_context(self.sync.paused())  # Lightning's work until the next batch

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.sync is None or self.sync.finished or trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is not None:
            self.sync.evaluated(float(value))

    def on_train_end(self, trainer, pl_module) -> None:
        if self.sync is None or self.sync.finished:
            return
        self._paused.close()
        self.summary = self.sync.finish()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """A failed fit leaves the run as a crash leaves it: its events and checkpoints kept,
        the event files closed and the module free for a new (resumed) Sync."""
        self._paused.close()
        if self.sync is not None and not self.sync.finished:
            self.sync.__exit__(type(exception), exception, exception.__traceback__)
            self.sync = None


def _main_input(batch) -> torch.Tensor | None:
    """A batch's main input: a dict's input_ids (else its first tensor), a sequence's first
    element, or the batch itself."""
    if isinstance(batch, Mapping):
        batch = batch.get("input_ids", next(iter(batch.values()), None))
    elif isinstance(batch, (list, tuple)):
        batch = batch[0] if batch else None
    return batch if torch.is_tensor(batch) else None


__all__ = ["LowbandCallback", "LowbandStrategy"]
