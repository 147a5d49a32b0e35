"""`lowband train | plan | report`.

`lowband train` run plainly starts R x S local worker processes itself; under torchrun or TorchX
(RANK and WORLD_SIZE in the environment) it is one worker and takes the world from there.
Errors a user can cause end with one sentence on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from lowband.config import ArgParser, Config, ConfigError, fields
from lowband.units import fmt_si


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


def is_worker() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def cmd_train(argv: list[str]) -> int:
    cfg, resume = parse_train(argv)
    if is_worker():
        import torch.distributed as dist

        from lowband.train import TrainingStopped, train

        try:
            train(cfg, resume=resume)
        except (ConfigError, TrainingStopped) as e:
            error = "error: " if isinstance(e, ConfigError) else ""
            print(f"lowband: {error}{e}", file=sys.stderr, flush=True)
            # leave at once: tearing down a live gloo group at interpreter exit can abort
            os._exit(2 if isinstance(e, ConfigError) else 3)
        if dist.is_initialized():
            dist.destroy_process_group()
        return 0
    return launch_local(cfg, argv)


def launch_local(cfg: Config, argv: list[str]) -> int:
    from lowband.data import load_tokens
    from lowband.local import LocalJob, describe_exit, last_line
    from lowband.telemetry import RunDir

    load_tokens(cfg.data)  # build the corpus cache once, before the workers all want it
    run = RunDir(cfg.run_dir or os.path.join("runs", f"{cfg.algo}-{time.strftime('%Y%m%d-%H%M%S')}"))
    run.create()
    code, rank = LocalJob(argv, cfg.world, run).wait()
    if code == 130:
        print("lowband: interrupted; the workers were stopped.", file=sys.stderr)
        return 130
    if code != 0:
        log = run.logs / f"rank{rank}.log"
        if rank != 0:
            detail = last_line(log)
            if detail:
                print(detail, file=sys.stderr)
        if code != 2:
            where = f"; its log: {log}" if rank != 0 else ""
            print(f"lowband: error: worker rank {rank} {describe_exit(code)}, so the other "
                  f"workers were stopped{where}.", file=sys.stderr)
        return code if code > 0 else 1
    summary = run.read_json(run.summary) or {}
    print(f"run directory: {run.root}")
    print(one_line(summary))
    return 0


def one_line(s: dict) -> str:
    return (f"{s.get('algorithm')} R={s.get('replicas')} S={s.get('shards')}: "
            f"loss {s.get('final_loss', float('nan')):.4f}, "
            f"val loss {s.get('final_val_loss', float('nan')):.4f}, "
            f"{s.get('tokens_per_s', 0):,.0f} tokens/s, "
            f"outer link {fmt_si(s.get('outer_wire_bytes', 0), 'B')}, "
            f"compute utilization {100 * s.get('compute_utilization', 0):.0f}%")


COMMANDS = {"train": cmd_train}


def _subcommand(module: str):
    def run(argv):
        import importlib

        return importlib.import_module(module).main(argv)

    return run


COMMANDS["plan"] = _subcommand("lowband.plan")
COMMANDS["report"] = _subcommand("lowband.report")
COMMANDS["launch"] = _subcommand("lowband.launch")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        if argv and argv[0] in ("-h", "--help"):
            print(f"usage: lowband {{{','.join(COMMANDS)}}} ...  (lowband COMMAND --help for each)")
            return 0
        if argv and not argv[0].startswith("-"):
            print(f"lowband: error: unknown command '{argv[0]}': use one of "
                  f"{', '.join(COMMANDS)}.", file=sys.stderr)
            return 2
        argv = ["train", *argv]  # `lowband` alone (or with flags) is `lowband train`
    try:
        return COMMANDS[argv[0]](argv[1:])
    except ConfigError as e:
        print(f"lowband: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
