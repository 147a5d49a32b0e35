"""lowband.Sync's Config: `lowband train`'s options by their Python names, with its defaults,
a recipe's values under them, the launched job's layout (launch/env.py) over them; the options
of lowband's own loop refused (the user's loop owns the model, the data, the learning rate and
its schedule, the evaluation), and so is an option of another algorithm."""

from __future__ import annotations

import dataclasses
import os
import re

from lowband import recipes
from lowband.config import Config, ConfigError, RunOptions
from lowband.faults import FaultOptions
from lowband.launch.env import job_layout
from lowband.models import ModelOptions
from lowband.options import close_match, flag

# RunOptions fields that only lowband's own loop reads
LOOP_ONLY = ("data", "tokenizer", "val_fraction", "optimizer", "lr", "min_lr_ratio",
             "warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip", "eval_every",
             "eval_batches", "time_budget", "compile", "precision", "progress", "max_skips",
             "stop_after", "grace", "replica_accum", "oversubscribe")
# (a replica's batch is your loop's; --grace's rejoin is tested in lowband's own loop only;
# whether a run fits the machine is asked by `lowband train`'s launcher, launch/fits.py)


def loop_only() -> set[str]:
    return {*LOOP_ONLY, *(f.name for f in dataclasses.fields(ModelOptions)),
            *(f.name for f in dataclasses.fields(FaultOptions))}


def config_of(algo: str, recipe: str | None, options: dict, n_blocks: int) -> Config:
    """The validated Config of a lowband.Sync (module doc); n_blocks: the wrapped model's."""
    theirs = loop_only()
    known = {f.name for f in dataclasses.fields(Config)} - theirs
    for key in options:
        if key not in known and key not in theirs:
            meant = close_match(key, known)
            raise ConfigError(f"unknown option {key}: " + (
                f"did you mean {meant}? (" if meant else "remove it: ") + "lowband.Sync takes "
                "`lowband train`'s options by their Python names, sync_every=20 for "
                "--sync-every 20" + (")." if meant else "."))
        if key in theirs:
            raise ConfigError(f"{key}= is an option of `lowband train`'s own loop ({flag(key)}): "
                              "in your loop, your model, data, optimizer and schedule decide it; "
                              "remove it from lowband.Sync.")
    given = job_layout(options)  # under lowband launch: the job's layout
    given.pop("progress", None)
    base = {k: v for k, v in recipes.get(recipe).values.items() if k not in theirs} if recipe else {}
    # lowband's own loop evaluates every --eval-every steps; here your loop does (val_loss=)
    values = {**base, "algo": algo, **options, **given, "eval_every": 0}
    if "replicas" not in values:  # under torchrun: every rank its own replica group by default
        shards = values.get("shards", RunOptions.shards)
        values["replicas"] = max(int(os.environ.get("WORLD_SIZE", 1)) // shards, 1)
    cfg = Config.from_dict(values, source="lowband.Sync")
    cfg.model_blocks = n_blocks
    cfg.validate()
    for note in cfg.ignored():  # a shared knob another algorithm reads: an error here
        name, users = re.match(r"--(\S+) is read only by --algo (.+): --algo", note).groups()
        raise ConfigError(f"{name.replace('-', '_')}= is read only by algo {users}, so "
                          f"algo={cfg.algo!r} would ignore it: remove it from lowband.Sync.")
    return cfg
