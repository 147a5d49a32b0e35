"""What a launched training script reads of its job: the layout lowband gave it.

`lowband.launch(script=...)` (and `lowband launch --script`) sets these on every worker:

    LOWBAND_REPLICAS   R, replica groups (joined by the slow outer link)
    LOWBAND_SHARDS     S, ranks inside each replica group
    LOWBAND_RUN_DIR    the run directory (on a filesystem every node shares)
    LOWBAND_PROGRESS   1 or 0: whether rank 0 shows a progress bar (0 for batch logs)
    LOWBAND_SECRET_FILE  the run's secret's path, RUN_DIR/secret (comm/membership/secret.py: the job's
                       spec names the file; lowband launch writes it before it submits)

and, in an elastic job (`lowband launch --elastic --script`), lowband train's elastic options,
the launcher's for every group (its Lighthouse and restarts follow them):

    LOWBAND_ELASTIC          1: each replica group a job of its own, joined by the Lighthouse
    LOWBAND_MIN_REPLICAS     --min-replicas
    LOWBAND_MAX_RESTARTS     --max-restarts
    LOWBAND_QUORUM_TIMEOUT   --quorum-timeout (seconds)
    LOWBAND_ELASTIC_TIMEOUT  --elastic-timeout (seconds)

beside torchft's TORCHFT_LIGHTHOUSE and the group's LOWBAND_REPLICA (comm/membership/elastic.py), so the
script builds its Config from them:

    from lowband.launch import launch_config
    cfg = launch_config(algo="streaming", steps=500)   # Config(replicas=R, shards=S, run_dir=...)
    train(cfg, model=my_module)

The names are lowband.options' (ENV: the table of every variable lowband reads or sets); this
module reads os.environ and imports nothing else of lowband at import time.
"""

from __future__ import annotations

import os

from lowband.options import (ELASTIC_ENV, ELASTIC_TIMEOUT_ENV, HEARTBEAT_TIMEOUT_ENV,
                             MAX_RESTARTS_ENV, MIN_REPLICAS_ENV, PROGRESS_ENV, QUORUM_TIMEOUT_ENV,
                             REPLICAS_ENV, RUN_DIR_ENV, SHARDS_ENV)

# the workers' environment that tells a job's processes their layout, in the order of
# (replicas, shards, run_dir, progress); component.py sets it, layout() reads it back
LAYOUT_ENV = (REPLICAS_ENV, SHARDS_ENV, RUN_DIR_ENV, PROGRESS_ENV)
# an elastic job's options (Config's names, ElasticOptions in comm/membership/elastic.py): their
# variables and types; component.py sets them on every replica group of an elastic job
ELASTIC_VARS = {"elastic": (ELASTIC_ENV, bool), "min_replicas": (MIN_REPLICAS_ENV, int),
                "max_restarts": (MAX_RESTARTS_ENV, int),
                "quorum_timeout": (QUORUM_TIMEOUT_ENV, float),
                "elastic_timeout": (ELASTIC_TIMEOUT_ENV, float),
                "heartbeat_timeout": (HEARTBEAT_TIMEOUT_ENV, float)}


def layout() -> dict:
    """The job's layout from the environment, as Config keywords: replicas, shards, run_dir and
    progress, those whose variable is set (all four under lowband.launch; none under a plain
    torchrun, so `Config(**layout(), ...)` works either way); in an elastic job, its elastic
    options too (ELASTIC_VARS)."""
    from lowband.config import ConfigError

    out: dict = {}
    numbers = {"replicas": (REPLICAS_ENV, int), "shards": (SHARDS_ENV, int),
               **{k: v for k, v in ELASTIC_VARS.items() if k != "elastic"}}
    for key, (var, kind) in numbers.items():
        value = os.environ.get(var)
        if value is not None:
            try:
                out[key] = kind(value)
            except ValueError:
                what = "a whole number" if kind is int else "a number"
                raise ConfigError(f"{var}={value!r} is not {what}: it is set by "
                                  "lowband.launch, leave it to it.") from None
    if os.environ.get(RUN_DIR_ENV):
        out["run_dir"] = os.environ[RUN_DIR_ENV]
    for key, var in (("progress", PROGRESS_ENV), ("elastic", ELASTIC_ENV)):
        if os.environ.get(var) is not None:
            out[key] = os.environ[var] not in ("0", "", "false", "no")
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
    for key in ("replicas", "shards", "run_dir", *ELASTIC_VARS):
        if key in given and key in options and options[key] != given[key]:
            raise ConfigError(f"{key}={options[key]!r} contradicts the launched job's "
                              f"{key}={given[key]!r}: leave {key} to lowband.launch.")
    return given
