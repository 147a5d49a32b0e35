"""`lowband train` on this machine, without TorchX: the checks made before any worker starts,
the run directory claimed, R x S workers started (local.py; --elastic: supervise.py's groups)
and waited for, and one sentence when one failed. A run refused before its first step leaves
no directory it made. `lowband train` (cli.py) and `lowband
compare` (compare/) both start their runs here, so a compared run is started as a trained one.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lowband.comm.membership.elastic import TORCHFT
from lowband.comm.topology import pick_backend, pick_device
from lowband.config import Config
from lowband.launch.fits import fit_here
from lowband.launch.local import LocalJob, describe_exit, last_line
from lowband.options import PREEMPTED, UserError, needs_extra
from lowband.telemetry import RunDir, new_run_dir, to_make, unmake


def train_here(cfg: Config, argv: list[str], resume: bool = False, hosts=None
               ) -> tuple[int, RunDir]:
    """Run `lowband train ARGV` (cfg: its validated config) on this machine: (exit status, its
    run directory). 0: finished, summary.json written; 130: interrupted; otherwise the cause is
    on stderr already. hosts: test hosts (lowband.launch.hosts) to run replica i on host i
    (not with --elastic)."""
    from lowband.data import Batches, load_corpus, vocab_needed
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
    # what a worker would refuse, asked before the run directory is touched: the device and
    # backend, and the corpus (read and cached once): too small for the model's vocabulary or
    # for the ranks' shards, it loses nothing
    pick_backend(cfg.backend, pick_device(cfg.device))
    fit_here(cfg)  # its ranks and their memory against this machine's (launch/fits.py)
    tokens = load_corpus(cfg.data, cfg.tokenizer, cfg.progress)
    check_vocab(cfg, vocab_needed(tokens))
    Batches(tokens, rank=0, world=cfg.world, seq_len=cfg.seq_len, batch_size=cfg.batch_size,
            seed=cfg.seed, val_fraction=cfg.val_fraction)
    made = to_make(Path(cfg.run_dir or "runs"))  # what making the run directory creates
    run = RunDir(cfg.run_dir) if cfg.run_dir else None
    try:
        if cfg.run_dir:  # refused before any worker starts if it holds another run (RunDir.claim)
            from lowband.checkpoint.lifecycle import relaunched

            keep = resume or relaunched(cfg)  # --auto-resume into the same run: its workers go on
            run = RunDir(cfg.run_dir).create() if keep else RunDir(cfg.run_dir).claim(cfg.overwrite)
        else:
            run = new_run_dir(cfg.algo)
            made.insert(0, run.root)
        if not resume:  # (a resume names its run and step: lifecycle.resume_point)
            print(f"lowband: run directory {run.root}; its logs: {run.logs}", file=sys.stderr,
                  flush=True)
        if cfg.elastic:  # the Lighthouse and R groups, each a job of its own (launch/supervise.py)
            from lowband.launch.supervise import run_elastic

            code, rank = run_elastic(cfg, argv, run), 0
        else:
            code, rank = LocalJob(argv, cfg.world, run, hosts=hosts, shards=cfg.shards).wait()
    except (UserError, OSError):  # refused before its first step: the directories it made go
        if run is not None and made:  # (a directory that was there is left as it was)
            unmake(run, made)
        raise
    if code == 130:  # where the run was, and whether a checkpoint can continue it
        from lowband.checkpoint.preempt import interrupted

        print(interrupted(run), file=sys.stderr)
        return 130, run
    if code != 0:
        log = run.logs / f"rank{rank}.log"
        if rank != 0:
            detail = last_line(log)
            if detail:
                print(detail, file=sys.stderr)
        if code == 2 and made:  # a worker refused the run, in the sentence printed: nothing to keep
            unmake(run, made)
        if code not in (2, 3, PREEMPTED):  # 2, 3, 5: the worker's own sentence says what happened
            where = f"; its log: {log}" if rank != 0 else ""
            print(f"lowband: error: worker rank {rank} {describe_exit(code)}, so the other "
                  f"workers were stopped{where}.", file=sys.stderr)
        return (code if code > 0 else 1), run
    return 0, run
