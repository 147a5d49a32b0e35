"""lowband.Sync inside other frameworks' training loops.

transformers: the Hugging Face Trainer (`LowbandCallback`, `LowbandTrainingArguments`).
lightning: PyTorch Lightning's Trainer (`LowbandCallback`, `LowbandStrategy`).
Each integration imports its framework, so import the one you use by its full name.

What follows is what their callbacks share, with no framework imported: the refusals of
options and layouts a framework's loop cannot run, and the Sync around its model and optimizer.
Each framework's texts come from its `Framework`, so the sentences say whose loop it is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from lowband.algorithms import ALGORITHMS
from lowband.algorithms.base import IN_BACKWARD
from lowband.config import Config, ConfigError
from lowband.sync import Sync, check_fits, either, fitting


def job_rank(variable: str = "RANK") -> int:
    """This process's place in the job from torchrun's variables (RANK, LOCAL_RANK,
    WORLD_SIZE), 0 where it runs alone."""
    return int(os.environ.get(variable, 0))


@dataclass(frozen=True)
class Framework:
    """What a framework's LowbandCallback says of the framework in its refusals."""
    who: str  # whose loop it is: "the Trainer" (as in "the Trainer's max_steps")
    backward: str  # "which X runs, ...": who runs the backward pass, and what it does there
    ddp: str  # what to use for ddp instead
    owned: dict  # the lowband options the framework sets: option -> where it is set
    place: str  # where to set those ("in the TrainingArguments")
    resume: str  # how its checkpoints meet lowband's (checkpoint_every)

    @property
    def refused(self) -> dict[str, str]:
        """The ways of fitting a loop (algorithms/base.py's user_loop) the framework's loop
        cannot take, and why (check_fits)."""
        return {IN_BACKWARD: f"it averages gradients inside the backward pass, {self.backward}: "
                             f"{self.ddp}"}


def check_options(fw: Framework, algo: str, options: dict) -> None:
    """LowbandCallback's refusals when it is made: an algorithm the loop cannot run, a local step
    count other than fixed, an option the framework sets itself."""
    if algo not in ALGORITHMS:
        names = either([repr(name) for name in fitting(tuple(fw.refused))])
        raise ConfigError(f"LowbandCallback runs algo={names}, not {algo!r}.")
    check_fits(algo, "LowbandCallback", fw.refused)
    if options.get("local_steps", "fixed") != "fixed":
        raise ConfigError(f"LowbandCallback runs local_steps='fixed': with other counts a slower "
                          f"replica runs fewer steps than {fw.who}'s max_steps; use lowband.Sync "
                          "in your own loop (for step in sync.range()).")
    for key, where in fw.owned.items():
        if key in options:
            raise ConfigError(f"{key}= is {where} here: set it {fw.place} and remove it from "
                              "LowbandCallback.")


def check_layout(fw: Framework, cfg: Config) -> None:
    """One rank a replica group, not elastic: what a framework's loop can run."""
    if cfg.shards > 1:
        raise ConfigError(f"LowbandCallback runs one rank a replica group, not shards="
                          f"{cfg.shards}: a replica's ranks average gradients inside the "
                          f"backward pass, {fw.backward}; use lowband.Sync in your own loop "
                          "(sync.backward) or `lowband train`.")
    if cfg.elastic:
        raise ConfigError(f"LowbandCallback does not run elastic: a group healed from a live "
                          f"peer goes on from the peer's step, which {fw.who}'s own step count, "
                          "schedule and data position cannot follow; use lowband.Sync in your "
                          "own loop (for step in sync.range()) for an elastic job.")


def start_sync(fw: Framework, model, optimizer, algo: str, *, step: int, recipe: str | None,
               blocks, resume: bool, options: dict) -> Sync:
    """The Sync around the framework's model and optimizer as its training begins, at its
    `step` (a resumed run's): the learning rates stay the framework's schedule's (not a resumed
    checkpoint's), and lowband's run must continue from the same step."""
    lrs = [group["lr"] for group in optimizer.param_groups]  # the framework's schedule's
    sync = Sync(model, optimizer, algo, recipe=recipe, blocks=blocks, resume=resume, **options)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    if sync.start_step != step:
        with sync:  # left as a crash leaves it: its events closed, the model free
            raise ConfigError(f"lowband's run continues after step {sync.start_step} but "
                              f"{fw.who}'s after step {step}: resume both from the same step "
                              f"({fw.resume}).")
    return sync
