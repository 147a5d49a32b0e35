"""A run stopped by SIGTERM or SIGUSR1: every rank stops after the same step, a checkpoint is
written there, and one sentence says where the run stopped and how it continues.

SIGTERM is what Slurm, Kubernetes and `kill` send before they kill a job; SIGUSR1 is what Slurm
sends before a time limit (`sbatch --signal=USR1@SECS`, which `lowband launch -s slurm
--requeue` asks for). A `lowband train` worker installs `HANDLER` (cli.py), which only notes the
signal. The ranks agree at checks every rank reaches: every `period` steps of the run's schedule
(every step for the algorithms that use the outer link every step; every H/P steps for the
periodic ones, where the replicas meet at a sync anyway), each an asynchronous 1-element
all-reduce (MAX) of the noted signal over a gloo group of its own, read after the step that
follows (where the replicas meet anyway: a fragment's merge), so that no replica waits for
another between its syncs. A signal that reached one rank only, or ranks at different steps,
stops every rank after the same step: at most a period and a step after it. The loop writes a checkpoint there (with or without --checkpoint-every) and ends
with `Preempted`: its sentence on stderr and exit status PREEMPTED (5, lowband.options).

On Slurm with LOWBAND_REQUEUE (`lowband launch --requeue`) rank 0 then requeues the job after
SIGUSR1 (`scontrol requeue`), which continues from that checkpoint by itself (a relaunch:
lifecycle.relaunched); after SIGTERM (scancel, or a preemption that Slurm requeues itself) not.

Left out: aedit (its replicas share no step to stop at) and --elastic runs (each group a world
of its own, which its launcher restarts) keep the default disposition: the process ends at once.
A lowband.Sync loop installs nothing: the signal does what the user's program says.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import torch
import torch.distributed as dist

from lowband import checkpoint
from lowband.algorithms.base import EVERY_STEP
from lowband.checkpoint.lifecycle import decided_by_rank0
from lowband.options import PREEMPT_SIGNALS, PREEMPTED, REQUEUE_ENV, WORKER_ENV, UserError
from lowband.telemetry import parse_event

SIGNALS = tuple(getattr(signal, name) for name in PREEMPT_SIGNALS)


class Preempted(UserError):
    """A run a signal stopped after a checkpoint; the message says where and how to go on."""
    code, label = PREEMPTED, ""


class Preemption:
    def __init__(self):
        self.signum = 0       # the signal this rank noted (0: none)
        self.saved = {}       # the handlers installed over: {signal: previous handler}
        self.period = 0       # run steps between the checks (0: no checks)
        self.group = None
        self.pending = None   # (flag, work) of the last check's all-reduce

    def install(self) -> None:
        """Note SIGTERM and SIGUSR1 from now on (the main thread only can)."""
        if threading.current_thread() is threading.main_thread():
            self.saved = {sig: signal.signal(sig, self._note) for sig in SIGNALS}

    def _note(self, signum, _frame) -> None:
        self.signum = self.signum or signum

    def uninstall(self) -> None:
        """The handlers as they were; a signal noted meanwhile is delivered again to them."""
        for sig, before in self.saved.items():
            signal.signal(sig, before)
        self.saved, self.period = {}, 0
        if self.signum:
            os.kill(os.getpid(), self.signum)

    def start(self, cfg, algo) -> None:
        """Before the loop, on every rank alike: the checks' period and group (a collective)."""
        if not self.saved:
            return
        if algo.timed or cfg.elastic:  # no common step to stop at / a group restarted alone
            self.uninstall()
            return
        every = (getattr(cfg, "sync_every", None) or 1) // (getattr(cfg, "fragments", None) or 1)
        self.period = 1 if algo.kind == EVERY_STEP else max(every, 1)
        self.group, self.pending = dist.new_group(backend="gloo"), None

    def stops(self, at: int | None, ends: bool) -> int:
        """After a step whose run step is `at` (None: between syncs, no common point): the
        signal on which every rank stops here (0: none). A check's all-reduce starts at a step
        that is a multiple of the period and is read after the next step with a run step (where
        the replicas meet anyway: a streaming fragment's merge, tau = 1); the run's last step
        ends it as planned instead (every rank alike)."""
        if not self.period or at is None:
            return 0
        signalled = 0
        if self.pending is not None:
            flag, work = self.pending
            self.pending = None
            work.wait()
            signalled = 0 if ends else int(flag.item())
        if not signalled and not ends and at % self.period == 0:
            flag = torch.tensor([float(self.signum)])
            self.pending = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group,
                                                  async_op=True))
        return signalled


HANDLER = Preemption()


def stopped(session, signum: int, at: int) -> Preempted:
    """After the checkpoint at run step `at`: the sentence (and on Slurm, the requeue)."""
    cfg, run = session.cfg, session.run
    name = signal.Signals(signum).name
    path = checkpoint.latest(run)
    of = "" if cfg.time_budget else f" of {cfg.steps}"
    job = requeue_job(signum, os.environ)
    if job is not None:  # before any rank leaves (srun's --kill-on-bad-exit would end rank 0)
        job = decided_by_rank0(lambda: _requeue(job))
    if job is not None:
        how = f"Slurm job {job} is requeued and continues from it by itself"
    elif os.environ.get(WORKER_ENV):  # `lowband train`'s own worker
        how = f"continue with: lowband train --resume {run.root}"
    else:
        how = f"continue with --resume {run.root}"
    return Preempted(f"stopped by {name} at step {at}{of}; checkpoint {path}; {how}")


def _requeue(job: str) -> str | None:
    """scontrol requeue JOB: the job if Slurm took it, else None (and why, on stderr)."""
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True,
                              timeout=60)
        why = done.stderr.strip() if done.returncode else None
    except (OSError, subprocess.TimeoutExpired) as e:
        why = str(e)
    if why is None:
        return job
    print(f"lowband: scontrol requeue {job} failed ({why}), so the job is not requeued.",
          file=sys.stderr, flush=True)
    return None


def requeue_job(signum: int, env) -> str | None:
    """The Slurm job to requeue after a stop: the job's (its first component's, in a
    heterogeneous job) when it asked for it (LOWBAND_REQUEUE=1) and the signal is Slurm's
    warning before its time limit (SIGUSR1); None after SIGTERM (scancel, or a preemption Slurm
    requeues itself) and outside such a job."""
    if signum != signal.SIGUSR1 or env.get(REQUEUE_ENV) != "1":
        return None
    return env.get("SLURM_JOB_ID_HET_GROUP_0") or env.get("SLURM_JOB_ID") or None


def interrupted(run) -> str:
    """The launcher's sentence after Ctrl-C: where the run was (rank 0's last step event) and
    what can be resumed (its latest checkpoint)."""
    step = last_step(run)
    at = f" at step {step}" if step is not None else ""
    path = checkpoint.latest(run)
    if path is None:
        return f"lowband: interrupted{at}; no checkpoint: nothing to resume."
    return (f"lowband: interrupted{at}; resume from checkpoint step {int(path.name[5:])} with "
            f"--resume {run.root}.")


def last_step(run, tail: int = 1 << 16) -> int | None:
    """The step of rank 0's last `step` event (read from the end of its file), or None."""
    try:
        with open(run.event_file(0), "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - tail, 0))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        event = parse_event(line)
        if event is not None and event.get("kind") == "step":
            return event["step"]
    return None
