"""The flags of `lowband train`: one per Config field, grouped in --help as the option groups
are (the run's own, the model's, the link's and the faults', then each algorithm's, titled with
the algorithms that read it), and the parse of a command line into a Config."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lowband import models
from lowband.algorithms import ALGORITHMS, users
from lowband.comm.link import recorded, with_units
from lowband.config import (COMMON_GROUPS, GROUPS, RESUME_MAY_CHANGE, RESUME_RULE, ArgParser,
                            Config, ConfigError)


TRAIN = ("Train a language model across ranks and replicas. With no arguments: the main job "
         "(streaming DiLoCo over an emulated 100 Mbit/s, 10 ms link), whose values are the "
         "defaults below, so a flag changes only what it names (--algo ddp: the baseline over "
         "the same link; --link-bandwidth none: no emulated link). Flags override --recipe or "
         "--config.")


def train_parser(prog: str = "lowband train", description: str = TRAIN,
                 resume: bool = True) -> argparse.ArgumentParser:
    """The parser of `lowband train`'s command line; `lowband plan` builds its own on it (its
    prog and description, without --resume), so both take the same options."""
    ALGORITHMS.load()  # algorithms registered from outside bring their option groups
    p = ArgParser(prog=prog, description=description, argument_default=argparse.SUPPRESS)
    p.add_argument("--recipe", help="start from a named recipe (`lowband recipes` lists them)")
    p.add_argument("--config", help="start from a TOML file whose keys are these options' names, "
                   "a run's config.json, or a run directory (to repeat that run)")
    if resume:
        p.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its latest "
                       f"checkpoint ({RESUME_RULE})")
    p.add_argument("--max-seconds", type=float, help=argparse.SUPPRESS)  # renamed: one sentence
    per_algorithm = {name for a in ALGORITHMS.values() for name in a.defaults}
    for group in GROUPS:
        title = f"{group.title} options"
        if group not in COMMON_GROUPS:
            title += f" (--algo {', '.join(users(group))})"
        section = p.add_argument_group(title)
        for f in group.__dataclass_fields__.values():
            if f.name not in group.names():
                continue
            flag = "--" + f.name.replace("_", "-")
            default = f.metadata.get("shown") or (
                ("per algorithm" if f.name in per_algorithm else "none") if f.default is None
                else repr(f.default))
            help_ = f"{f.metadata['help']} (default: {default})"
            if isinstance(f.default, bool):
                section.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_)
            else:
                section.add_argument(flag, type=f.metadata["type"], help=help_,
                                     metavar=f.name.upper())
    return p


def parse_train(argv: list[str], *, here: bool = True) -> tuple[Config, bool]:
    """The config of `lowband train ARGV`, validated, and whether it resumes a run.

    here=False: the run starts on a cluster (`lowband launch` to a remote scheduler), whose paths
    need not exist here: a --config file, data, tokenizer or model files (hf:PATH) not found here
    are the nodes' to check, and everything else is checked as `lowband train` checks it. A
    --resume run directory is read here either way: the job's layout is the run's own."""
    return config_of_args(vars(train_parser().parse_args(argv)), here=here)


def config_of_args(args: dict, *, here: bool = True, file_here: bool | None = None
                   ) -> tuple[Config, bool]:
    """parse_train's config from the parsed arguments (a dict of train_parser's, emptied).
    file_here: the --config file must be here (default: as `here`; `lowband plan` reads it
    here and leaves the paths it names unchecked)."""
    if "max_seconds" in args:
        raise ConfigError("--max-seconds is now --time-budget, one option for every algorithm: "
                          "give --time-budget SECONDS.")
    path, resume, recipe = args.pop("config", None), args.pop("resume", None), args.pop("recipe", None)
    if resume:
        other = sorted(set(args) - set(RESUME_MAY_CHANGE)) + (["config"] if path else []) + \
            (["recipe"] if recipe else [])
        if other:
            raise ConfigError(f"--resume takes the run's own config, so --{other[0].replace('_', '-')} "
                              f"cannot be given with it: {RESUME_RULE}.")
        from lowband.telemetry import RunDir

        saved = RunDir(resume).read_json(RunDir(resume).config)
        if saved is None:
            raise ConfigError(f"'{resume}' is not a lowband run directory (no config.json): give "
                              "the directory of the run to resume.")
        meta = saved.pop("meta", None)
        cfg = recorded(Config.from_dict(with_units(saved), source=f"{resume}/config.json"), meta)
        cfg.stop_after = cfg.crash_checkpoint = 0  # one-shot: done before, not again
        args["run_dir"] = resume
    elif path and recipe:
        raise ConfigError("--recipe and --config each give a whole configuration: pick one, and "
                          "put changes in flags.")
    elif path and (here if file_here is None else file_here or Path(path).exists()):
        cfg = Config.from_file(path)
    elif path:
        cfg = Config()
    else:
        from lowband import recipes

        cfg = recipes.get(recipe).config() if recipe else Config()
    for name, value in args.items():
        setattr(cfg, name, value)
    return (cfg.validate() if here else validate_elsewhere(cfg)), bool(resume)


def validate_elsewhere(cfg: Config) -> Config:
    """cfg.validate() with the paths not found here (data, tokenizer, a model's files) set aside
    for the check, as the nodes will check them."""
    default, saved = Config(), {}
    for key, path in (("data", None if cfg.data == "builtin" else cfg.data),
                      ("tokenizer", getattr(cfg, "tokenizer", "") or None),
                      ("model", models.files(cfg.model))):
        if path is not None and not Path(path).expanduser().exists():
            saved[key] = getattr(cfg, key)
            setattr(cfg, key, getattr(default, key))
    if "model" in saved:  # its block count is the nodes' to check (--fragments against it)
        cfg.model_blocks = sys.maxsize
    try:
        cfg.validate()
    finally:
        for key, value in saved.items():
            setattr(cfg, key, value)
        if "model" in saved:
            del cfg.model_blocks  # back to the source's own
    return cfg
