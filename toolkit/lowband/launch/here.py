"""`lowband train` on this machine, without TorchX: the checks made before any worker starts,
the run directory claimed, R x S workers started (local.py; --elastic: supervise.py's groups)
and waited for, and one sentence when one failed. `lowband train` (cli.py) and `lowband
compare` (compare/) both start their runs here, so a compared run is started as a trained one.
"""

from __future__ import annotations

import sys

from lowband.comm.membership.elastic import TORCHFT
from lowband.config import Config
from lowband.launch.local import LocalJob, describe_exit, last_line
from lowband.options import needs_extra
from lowband.telemetry import RunDir, new_run_dir


def train_here(cfg: Config, argv: list[str], resume: bool = False, hosts=None
               ) -> tuple[int, RunDir]:
    """Run `lowband train ARGV` (cfg: its validated config) on this machine: (exit status, its
    run directory). 0: finished, summary.json written; 130: interrupted; otherwise the cause is
    on stderr already. hosts: test hosts (lowband.launch.hosts) to run replica i on host i
    (not with --elastic)."""
    from lowband.data import load_corpus, vocab_needed
    from lowband.models import check_vocab

    if cfg.elastic and hosts is not None:
        raise ValueError("an elastic run starts its groups on this machine, not on test hosts")
    if cfg.elastic:  # asked here, before the run directory is made
        needs_extra(*TORCHFT)
    if resume:  # refused here, not by workers started for it (which would rewrite its logs)
        from lowband.checkpoint.lifecycle import check_resumable

        check_resumable(cfg)
    for note in cfg.ignored():
        print(f"lowband: note: {note}", file=sys.stderr)
    # the corpus is read (and cached) once, before the workers and before the run directory is
    # touched: a model too small for its vocabulary loses nothing
    check_vocab(cfg, vocab_needed(load_corpus(cfg.data, cfg.tokenizer, cfg.progress)))
    if cfg.run_dir:  # refused before any worker starts if it holds another run (see RunDir.claim)
        from lowband.checkpoint.lifecycle import relaunched

        keep = resume or relaunched(cfg)  # --auto-resume into the same run: its workers continue it
        run = RunDir(cfg.run_dir).create() if keep else RunDir(cfg.run_dir).claim(cfg.overwrite)
    else:
        run = new_run_dir(cfg.algo)
    if cfg.elastic:  # the Lighthouse and R groups, each a job of its own (launch/supervise.py)
        from lowband.launch.supervise import run_elastic

        code, rank = run_elastic(cfg, argv, run), 0
    else:
        code, rank = LocalJob(argv, cfg.world, run, hosts=hosts, shards=cfg.shards).wait()
    if code == 130:
        print("lowband: interrupted; the workers were stopped.", file=sys.stderr)
        return 130, run
    if code != 0:
        log = run.logs / f"rank{rank}.log"
        if rank != 0:
            detail = last_line(log)
            if detail:
                print(detail, file=sys.stderr)
        if code not in (2, 3):  # 2, 3: the worker's own sentence says what happened
            where = f"; its log: {log}" if rank != 0 else ""
            print(f"lowband: error: worker rank {rank} {describe_exit(code)}, so the other "
                  f"workers were stopped{where}.", file=sys.stderr)
        return (code if code > 0 else 1), run
    return 0, run
