"""The flags of `lowband train`: one per Config field, grouped in --help as the option groups
are (the run's own, the link's and the faults', then each algorithm's, titled with the
algorithms that read it), and the parse of a command line into a Config."""

from __future__ import annotations

import argparse

from lowband.algorithms import users
from lowband.config import COMMON_GROUPS, GROUPS, ArgParser, Config, ConfigError


def train_parser() -> argparse.ArgumentParser:
    p = ArgParser(prog="lowband train", description="Train a language model across ranks and "
                  "replicas. With no arguments: the main job (`--recipe main`: streaming DiLoCo "
                  "over an emulated slow link). Flags override --recipe or --config.",
                  argument_default=argparse.SUPPRESS)
    p.add_argument("--recipe", help="start from a named recipe (`lowband recipes` lists them)")
    p.add_argument("--config", help="start from a TOML file whose keys are these options' names, "
                   "a run's config.json, or a run directory (to repeat that run)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its latest "
                   "checkpoint with its own config (only --steps and --progress may change)")
    for group in GROUPS:
        title = f"{group.title} options"
        if group not in COMMON_GROUPS:
            title += f" (--algo {', '.join(users(group))})"
        section = p.add_argument_group(title)
        for f in group.__dataclass_fields__.values():
            if f.name not in group.names():
                continue
            flag = "--" + f.name.replace("_", "-")
            default = "per algorithm" if f.default is None else repr(f.default)
            help_ = f"{f.metadata['help']} (default: {default})"
            if isinstance(f.default, bool):
                section.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_)
            else:
                section.add_argument(flag, type=f.metadata["type"], help=help_,
                                     metavar=f.name.upper())
    return p


RESUME_MAY_CHANGE = {"steps", "progress", "run_dir", "stop_after"}


def parse_train(argv: list[str]) -> tuple[Config, bool]:
    """The config of `lowband train ARGV`, and whether it resumes a run."""
    args = vars(train_parser().parse_args(argv))
    path, resume, recipe = args.pop("config", None), args.pop("resume", None), args.pop("recipe", None)
    if resume:
        other = sorted(set(args) - RESUME_MAY_CHANGE) + (["config"] if path else []) + \
            (["recipe"] if recipe else [])
        if other:
            raise ConfigError(f"--resume takes the run's own config, so --{other[0].replace('_', '-')} "
                              "cannot be given with it: only --steps may change.")
        from lowband.telemetry import RunDir

        saved = RunDir(resume).read_json(RunDir(resume).config)
        if saved is None:
            raise ConfigError(f"'{resume}' is not a lowband run directory (no config.json): give "
                              "the directory of the run to resume.")
        saved.pop("meta", None)
        cfg = Config.from_dict(saved, source=f"{resume}/config.json")
        cfg.stop_after = cfg.crash_checkpoint = 0  # one-shot: done before, not again
        args["run_dir"] = resume
    elif path and recipe:
        raise ConfigError("--recipe and --config each give a whole configuration: pick one, and "
                          "put changes in flags.")
    elif path:
        cfg = Config.from_file(path)
    else:
        from lowband import recipes

        cfg = recipes.get(recipe).config() if recipe else Config()
    for name, value in args.items():
        setattr(cfg, name, value)
    return cfg.validate(), bool(resume)
