"""`python -m lowband.launch lighthouse`: an elastic job's first role (component.py,
--elastic): torchft's Lighthouse, serving the replica groups' quorums, that also ends the job.
When every group has written its record (RUN/groups/, on the shared filesystem) it writes
summary.json and exits; a group lost for good never writes one, so once the first record is
there the others get --wait seconds before the summary is written from those that finished.
When no group reaches it for --idle-timeout seconds (none started, or every one failed past
its restarts; the job's --quorum-timeout), the job ends with an error.
On Slurm (--slurm-groups) it also submits the groups' jobs and watches them (launch/slurm.py):
once none is left, it stops waiting."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

from lowband.comm.membership import secret
from lowband.comm.membership.bind import bind_host, url_host
from lowband.comm.membership.elastic import ElasticOptions, join_timeout_s
from lowband.comm.membership.lives import alive_groups
from lowband.faults import lighthouse_kill_asked
from lowband.launch.env import layout
from lowband.launch.slurm import GROUPS_ARG, GroupJobs
from lowband import summary
from lowband.launch.supervise import leave_out_stragglers, lighthouse
from lowband.options import BIND_ENV, SECRET_ENV, ConfigError
from lowband.telemetry import RunDir


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m lowband.launch lighthouse",
                                allow_abbrev=False)
    elastic = ElasticOptions()  # lowband train's defaults (component.py passes the job's)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--heartbeat-timeout", type=_positive, default=elastic.heartbeat_timeout,
                   help="seconds without a group's heartbeat before it is left out of a quorum")
    p.add_argument("--min-replicas", type=int, default=elastic.min_replicas)
    p.add_argument("--replicas", type=int, required=True, help="the run's replica groups")
    p.add_argument("--join-timeout", type=_positive, default=join_timeout_s(elastic),
                   help="seconds a quorum waits for a group that heartbeats but has not asked "
                   "(lowband.comm.membership.elastic.join_timeout_s)")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--wait", type=float, default=600.0,
                   help="seconds the other groups get once the first has finished")
    p.add_argument(GROUPS_ARG, metavar="DIR", help="Slurm: submit the groups' batch scripts "
                   "in DIR as jobs of their own (launch/slurm.py)")
    p.add_argument("--idle-timeout", type=_positive, default=layout().get("quorum_timeout"),
                   help="seconds in which no replica group reaches the Lighthouse (none started,"
                   " or every one failed past its restarts) before the job ends (default: the "
                   "job's --quorum-timeout; not with --slurm-groups, whose jobs say it)")
    a = p.parse_args(argv)
    # its address: --bind's, else the route to its node as the rank-0 host variable names it
    # (LOWBAND_RANK0_ENV, comm/membership/bind.py), else to its own host name; Slurm's group jobs dial it
    try:
        here = os.environ[BIND_ENV] = bind_host(peer=socket.gethostname())
    except ConfigError as e:
        print(f"lowband: error: {e}", file=sys.stderr, flush=True)
        return 2
    server = lighthouse(a.min_replicas, a.join_timeout, port=a.port,
                        heartbeat_timeout_s=a.heartbeat_timeout)
    print(f"lowband: lighthouse at {server.address()} for {a.replicas} replica groups",
          file=sys.stderr, flush=True)
    run = RunDir(a.run_dir)
    run.clear_group_records()  # (a resumed run's earlier part: its groups finish again)
    if os.environ.get(SECRET_ENV):  # the job's secret, if `lowband launch` has not
        secret.make(os.environ[SECRET_ENV])  # written it (a `torchx run` of its own)
    first_done, jobs, last_alive = None, None, time.monotonic()
    # a cancelled job's SIGTERM: cancel the group jobs on the way out (finally)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        if a.slurm_groups:
            try:
                jobs = GroupJobs(a.slurm_groups, a.port)
            except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                print(f"lowband: error: {e}; the run cannot start.", file=sys.stderr)
                return 1
        while True:
            done = len(run.group_records())
            if done and first_done is None:
                first_done = time.monotonic()
                if jobs is not None:
                    drop_stragglers(run, jobs)
            if done >= a.replicas or (first_done and time.monotonic() - first_done > a.wait):
                break
            if jobs is not None and not jobs.alive(late=first_done is not None):  # all ended
                time.sleep(2.0)  # (a record written just before its job ended)
                if not run.group_records():
                    print("lowband: every replica group's Slurm job ended without a record, so "
                          f"the run has no result: see {run.logs}.", file=sys.stderr)
                    return 1
                break
            if jobs is None and a.idle_timeout and not first_done:
                if alive_groups((), lighthouse=f"http://{url_host(here)}:{a.port}") != []:
                    last_alive = time.monotonic()  # (None: no answer, not the groups' fault)
                elif time.monotonic() - last_alive > a.idle_timeout:
                    print(f"lowband: no replica group has reached the Lighthouse for "
                          f"{a.idle_timeout:g} s (each failed past its restarts, or its script "
                          f"does not train through lowband.Sync), so the job ends; see {run.logs}.",
                          file=sys.stderr, flush=True)
                    return 1
            if lighthouse_kill_asked(run.root):  # --kill lighthouse:STEP: as if this host were lost
                print("lowband: the Lighthouse is stopped (--kill lighthouse).", file=sys.stderr)
                return 1
            time.sleep(1.0)
        if jobs is not None:
            jobs.end()
    finally:
        if jobs is not None:  # (at once, when the job is cancelled or fails)
            jobs.cancel()
        server.shutdown()
    cfg = run_config(run)
    summary.write_elastic(cfg, run)
    return 0


def run_config(run: RunDir):
    from lowband.config import Config

    cfg = Config.from_file(str(run.root / "config.json"))
    cfg.run_dir = str(run.root)
    return cfg


def drop_stragglers(run: RunDir, jobs) -> None:
    """A group has finished: the Slurm jobs of the groups that met no finished group since
    they last started are cancelled, and the summary leaves them out
    (supervise.leave_out_stragglers)."""
    unfinished = dict.fromkeys(range(len(jobs.ids)), 0.0)  # (their lives: from their events)
    for g, why in leave_out_stragglers(run_config(run), run, unfinished).items():
        jobs.cancel_group(g, why)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive seconds, got {text!r}")
    return value
