"""The flags of `lowband train`: one per Config field, grouped in --help as the option groups
are (the run's own, then each algorithm's), and the parse of a command line into a Config."""

from __future__ import annotations

import argparse

from lowband.config import ArgParser, Config, ConfigError, fields


def train_parser() -> argparse.ArgumentParser:
    p = ArgParser(prog="lowband train", description="Train a language model across ranks and "
                "replicas. With no arguments: the main job (a multi-replica run on the built-in "
                "corpus). Flags override --config FILE.toml.", argument_default=argparse.SUPPRESS)
    p.add_argument("--config", help="a TOML file whose keys are these options' names")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its latest "
                   "checkpoint with its own config (only --steps and --progress may change)")
    for f in fields():
        flag = "--" + f.name.replace("_", "-")
        default = "per algorithm" if f.default is None else repr(f.default)
        help_ = f"{f.metadata['help']} (default: {default})"
        if isinstance(f.default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_)
        else:
            p.add_argument(flag, type=f.metadata["type"], help=help_, metavar=f.name.upper())
    return p


RESUME_MAY_CHANGE = {"steps", "progress", "run_dir", "stop_after"}


def parse_train(argv: list[str]) -> tuple[Config, bool]:
    """The config of `lowband train ARGV`, and whether it resumes a run."""
    args = vars(train_parser().parse_args(argv))
    path, resume = args.pop("config", None), args.pop("resume", None)
    if resume:
        other = sorted(set(args) - RESUME_MAY_CHANGE) + (["config"] if path else [])
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
    else:
        cfg = Config.from_toml(path) if path else Config()
    for name, value in args.items():
        setattr(cfg, name, value)
    return cfg.validate(), bool(resume)
