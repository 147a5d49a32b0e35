"""`lowband train | plan | report | launch | recipes | prepare | export | compare | doctor`.

`lowband train` run plainly starts R x S local worker processes itself; under torchrun or TorchX
(RANK and WORLD_SIZE in the environment) it is one worker and takes the world from there.
Errors a user can cause end with one sentence on stderr and exit status 2.
"""

from __future__ import annotations

import os
import sys

from lowband.config import Config
from lowband.flags import parse_train
from lowband.options import WORKER_ENV, UserError, filesystem_error
from lowband.summary import comparison, one_line


def refused(e: UserError) -> int:
    """Every command's end on an error a user can fix or must know of (a UserError): its one
    sentence on stderr, no traceback; the exit status it names (2: bad input)."""
    print(f"lowband: {e.label}{e}", file=sys.stderr)
    if "TORCHELASTIC_ERROR_FILE" in os.environ:  # a worker under torchrun: its summary says it
        from lowband.launch.local import tell_agent

        tell_agent(f"lowband: {e.label}{e}")
    return e.code


def is_worker() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def cmd_train(argv: list[str]) -> int:
    argv = argv or ["--recipe", "main"]  # `lowband train` alone: the main job (workers too)
    cfg, resume = parse_train(argv)
    if is_worker():
        import torch.distributed as dist

        from lowband.checkpoint.preempt import HANDLER
        from lowband.train import train

        HANDLER.install()  # SIGTERM, SIGUSR1: every rank stops at one step, checkpointed (exit 5)

        def leave(code: int):
            """Flush what this process wrote, wait for the other ranks when it finished
            (the final barrier), then leave at once: tearing down live gloo groups and their
            threads at interpreter exit can abort a finished worker (SIGABRT, "terminate
            called without an active exception")."""
            import logging

            logging.shutdown()
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            if code in (0, DIVERGED) and dist.is_initialized():  # (a finished run)
                try:
                    dist.barrier()
                except Exception:  # a peer vanished: this rank's work is done and written
                    pass
            os._exit(code)

        try:
            if os.environ["RANK"] == "0" and not os.environ.get(WORKER_ENV):  # torchrun's: this
                from lowband.launch.fits import fit_here  # node's ranks against its machine

                fit_here(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])),
                         notes=False)
            summary = train(cfg, resume=resume)  # its files (events, summary, weights) are closed
            if summary and not os.environ.get(WORKER_ENV):  # not `lowband train`'s own
                # a launched job's log (stderr: the stream schedulers keep) ends with the result
                # and the report rank 0 writes (the ranks it waits for wait at the final barrier)
                from lowband.report import run_report

                print(f"run directory: {cfg.run_dir}\n{one_line(summary)}", file=sys.stderr,
                      flush=True)
                print(run_report(cfg.run_dir), file=sys.stderr, flush=True)
                if summary.get("diverged"):
                    print(diverged(summary), file=sys.stderr, flush=True)
                    leave(DIVERGED)
        except UserError as e:
            leave(refused(e))
        except KeyboardInterrupt:
            leave(130)
        except BaseException as e:  # a bug: its traceback, then the same direct exit
            fault = filesystem_error(e, cfg.run_dir, code=3)  # a full disk, a run directory gone
            if fault is not None:
                leave(refused(fault))
            from lowband.launch.local import peer_lost, quiet_end

            if peer_lost(e):  # not a bug: another worker died first, and is the one named
                leave(quiet_end(e))
            import traceback

            traceback.print_exc()
            leave(1)
        leave(0)
    return launch_local(cfg, argv, resume)


def launch_local(cfg: Config, argv: list[str], resume: bool = False) -> int:
    """Train on this machine; then print the run directory, its one line, what ddp would have
    sent (the headline, lowband.summary.comparison) and the report written into the run
    directory (or one sentence saying why none was)."""
    from lowband.launch.here import train_here
    from lowband.report import run_report

    code, run = train_here(cfg, argv, resume)
    if code != 0:
        return code
    summary = run.read_json(run.summary) or {}
    print(f"run directory: {run.root}")
    print(one_line(summary))
    line = comparison(summary, cfg.link_bandwidth)
    if line:
        print(line)
    print(run_report(run.root))
    if summary.get("diverged"):
        print(diverged(summary), file=sys.stderr)
        return DIVERGED
    return 0


DIVERGED = 4  # the exit status of a run that finished with a diverged loss (summary.json)
# PREEMPTED (lowband.options), 5: a run SIGTERM or SIGUSR1 stopped after writing a checkpoint,
# which `lowband train --resume RUN` continues (checkpoint/preempt.py, docs/faults.md)


def diverged(summary: dict) -> str:
    return (f"lowband: {summary['diverged']}; its model.pt is not a result to use (exit status "
            f"{DIVERGED}; see docs/faults.md).")


COMMANDS = {"train": cmd_train}


def _subcommand(module: str):
    def run(argv):
        import importlib

        return importlib.import_module(module).main(argv)

    return run


COMMANDS["plan"] = _subcommand("lowband.plan")
COMMANDS["report"] = _subcommand("lowband.report")
COMMANDS["launch"] = _subcommand("lowband.launch")
COMMANDS["prepare"] = _subcommand("lowband.data.cli")
COMMANDS["export"] = _subcommand("lowband.export")
COMMANDS["compare"] = _subcommand("lowband.compare")
COMMANDS["doctor"] = _subcommand("lowband.doctor")


def cmd_recipes(argv: list[str]) -> int:
    from lowband.recipes import main_cli

    return main_cli(argv)


COMMANDS["recipes"] = cmd_recipes


HELP = """usage: lowband COMMAND [OPTIONS]   (lowband COMMAND --help: a command's options)

commands:
  train    train a model across replicas: alone, the main job (below); a flag changes what it names
  plan     predict a run's bandwidth needs and compute utilization on its link, without training
  report   write an offline HTML report of one or more runs
  launch   run `lowband train` (or your script) as a TorchX job: here, Slurm, Kubernetes, ...
  recipes  list the named configurations (`lowband train --recipe NAME`)
  prepare  tokenize text, JSONL or Parquet files into token shards for --data
  export   write a finished run's weights as a Hugging Face model directory
  compare  train several algorithms, recipes or configs at equal time or tokens, side by side
  doctor   check that a run can work here and across machines, and measure the link between them

the main job: `lowband train` (Streaming DiLoCo, 2 replicas of a 0.8M GPT, 200 steps, over an
emulated 100 Mbit/s, 10 ms link); `lowband train --algo ddp` is its baseline over the same link,
`lowband train --steps 20` the same job shorter, `--link-bandwidth none` without the link."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):  # `lowband` alone starts nothing: the help
        print(HELP)
        return 0
    if argv[0] not in COMMANDS:
        if not argv[0].startswith("-"):
            print(f"lowband: error: unknown command '{argv[0]}': use one of "
                  f"{', '.join(COMMANDS)}.", file=sys.stderr)
            return 2
        argv = ["train", *argv]  # `lowband --steps 20` (flags, no command) is `lowband train`
    try:
        return COMMANDS[argv[0]](argv[1:])
    except UserError as e:
        return refused(e)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a full disk, a read-only directory, a file where a directory goes
        fault = filesystem_error(e)
        if fault is None:
            raise
        return refused(fault)


if __name__ == "__main__":
    sys.exit(main())
