"""`lowband train | plan | report | launch | recipes`.

`lowband train` run plainly starts R x S local worker processes itself; under torchrun or TorchX
(RANK and WORLD_SIZE in the environment) it is one worker and takes the world from there.
Errors a user can cause end with one sentence on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from lowband.config import Config, ConfigError
from lowband.flags import parse_train, train_parser  # noqa: F401 (train_parser: lowband.launch)
from lowband.summary import comparison, one_line


def is_worker() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def cmd_train(argv: list[str]) -> int:
    main_job = not argv
    argv = argv or ["--recipe", "main"]  # `lowband train` alone: the main job (workers too)
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
    return launch_local(cfg, argv, main_job)


def launch_local(cfg: Config, argv: list[str], main_job: bool = False) -> int:
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
    _main_job_extras(cfg, run, summary, report=main_job)
    return 0


def _main_job_extras(cfg: Config, run, summary: dict, report: bool) -> None:
    """Beside the run's own figures: what ddp would have sent, and (for the main job, `lowband
    train` alone) the HTML report to open."""
    from lowband.units import parse_bandwidth

    line = comparison(summary, parse_bandwidth(cfg.link_bandwidth or 0))
    if line:
        print(line)
    if report:
        from lowband.report import write_report

        path = write_report(run.root, run.root / "report.html")
        print(f"report: {path}")
    else:
        print(f"report: lowband report {run.root} -o report.html")


COMMANDS = {"train": cmd_train}


def _subcommand(module: str):
    def run(argv):
        import importlib

        return importlib.import_module(module).main(argv)

    return run


COMMANDS["plan"] = _subcommand("lowband.plan")
COMMANDS["report"] = _subcommand("lowband.report")
COMMANDS["launch"] = _subcommand("lowband.launch")


def cmd_recipes(argv: list[str]) -> int:
    from lowband.recipes import main_cli

    return main_cli(argv)


COMMANDS["recipes"] = cmd_recipes


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
