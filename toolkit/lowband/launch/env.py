"""What a launched training script reads of its job: the layout lowband gave it.

`lowband.launch(script=...)` (and `lowband launch --script`) sets these on every worker:

    LOWBAND_REPLICAS   R, replica groups (joined by the slow outer link)
    LOWBAND_SHARDS     S, ranks inside each replica group
    LOWBAND_RUN_DIR    the run directory (on a filesystem every node shares)
    LOWBAND_PROGRESS   1 or 0: whether rank 0 shows a progress bar (0 for batch logs)

so the script builds its Config from them:

    from lowband.launch import launch_config
    cfg = launch_config(algo="streaming", steps=500)   # Config(replicas=R, shards=S, run_dir=...)
    train(cfg, model=my_module)

This module reads only os.environ: it imports nothing of lowband at import time.
"""

from __future__ import annotations

import os

REPLICAS, SHARDS, RUN_DIR, PROGRESS = ("LOWBAND_REPLICAS", "LOWBAND_SHARDS", "LOWBAND_RUN_DIR",
                                       "LOWBAND_PROGRESS")


def layout() -> dict:
    """The job's layout from the environment, as Config keywords: replicas, shards, run_dir and
    progress, those whose variable is set (all four under lowband.launch; none under a plain
    torchrun, so `Config(**layout(), ...)` works either way)."""
    from lowband.config import ConfigError

    out: dict = {}
    for key, var in (("replicas", REPLICAS), ("shards", SHARDS)):
        value = os.environ.get(var)
        if value is not None:
            try:
                out[key] = int(value)
            except ValueError:
                raise ConfigError(f"{var}={value!r} is not a whole number: it is set by "
                                  "lowband.launch, leave it to it.") from None
    if os.environ.get(RUN_DIR):
        out["run_dir"] = os.environ[RUN_DIR]
    if os.environ.get(PROGRESS) is not None:
        out["progress"] = os.environ[PROGRESS] not in ("0", "", "false", "no")
    return out


def launch_config(**options):
    """A lowband Config for a launched script: the job's layout (layout()) with `options` over
    lowband's defaults. An option that contradicts the layout (replicas=4 in a job of 2 replica
    groups) is refused with one sentence: the job's processes are already laid out."""
    from lowband.config import Config

    return Config(**{**job_layout(options), **options})


def job_layout(options: dict) -> dict:
    """layout(), with one sentence for an option that contradicts it."""
    from lowband.config import ConfigError

    given = layout()
    for key in ("replicas", "shards", "run_dir"):
        if key in given and key in options and options[key] != given[key]:
            raise ConfigError(f"{key}={options[key]!r} contradicts the launched job's "
                              f"{key}={given[key]!r}: leave {key} to lowband.launch.")
    return given
