"""`lowband train --elastic` on one machine: a torchft Lighthouse and R replica groups, each a
job of its own (S local workers, launch.local.LocalJob), restarted when it dies.

The Lighthouse is torchft's own program (`torchft_lighthouse`), a process of its own whose
output goes to RUN/logs/lighthouse.log; every worker finds it through TORCHFT_LIGHTHOUSE, and
its group through LOWBAND_REPLICA (comm/membership/elastic.py). A group that dies (a killed node, a crash)
is started again, up to --max-restarts times: it continues from its newest intact checkpoint
(checkpoint/lifecycle.py: restarted_group), or afresh without one, heals from a live peer that
trained further at the others' next sync, and trains on. A group that refuses its input (status
2) or stops on purpose (3: no quorum within --quorum-timeout) stops the whole job: the others
would meet it too. A Lighthouse that dies is started again on its port (restart_lighthouse);
the groups' quorums wait for it. Once a group has finished, a group that has met no finished
group in a quorum since it last started is stopped, and a group that dies is not restarted
(leave_out_stragglers): no live peer is left to heal them. When every group has finished or is
lost for good, the groups' records (RUN/groups/) become summary.json, with what the faults cost
(elastic_record).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from lowband.checkpoint.lifecycle import RESTART_COUNT
from lowband.comm.membership import secret
from lowband.comm.membership.bind import bind_host, url_host
from lowband.comm.membership.elastic import TORCHFT, join_timeout_s, quiet_rust
from lowband.comm.membership.lives import lighthouse_life
from lowband.faults import lighthouse_kill_asked
from lowband.launch.local import LocalJob, describe_exit, free_port, last_line
from lowband import summary
from lowband.options import (LIFE_ENV, LIGHTHOUSE_ENV, REPLICA_ENV, SECRET_ENV, ConfigError,
                             missing_extra, needs_extra)
from lowband.telemetry import RunDir, read_events, write_json_atomic



def lighthouse(min_replicas: int, join_s: float, port: int = 0, heartbeat_timeout_s: float = 5.0):
    """torchft's Lighthouse, serving in this process on bind_host() (port 0: a free one);
    join_s: how long a quorum waits for a group that heartbeats but has not asked
    (comm/membership/elastic.join_timeout_s); a group whose heartbeats stop for heartbeat_timeout_s
    (torchft's default: 5 s) is left out of the next quorum."""
    quiet_rust()
    needs_extra(*TORCHFT)
    from torchft._torchft import LighthouseServer

    return LighthouseServer(bind=f"{url_host(bind_host())}:{port}", min_replicas=min_replicas,
                            join_timeout_ms=int(join_s * 1000),
                            heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000))


def lighthouse_process(cfg, log: Path, ready_s: float = 30.0,
                       port: int = 0) -> tuple[subprocess.Popen, str]:
    """torchft's Lighthouse program for the run of `cfg` (its --min-replicas, join timeout and
    --heartbeat-timeout) on bind_host() and `port` (0: a free local one), and its address once
    it answers."""
    exe = shutil.which("torchft_lighthouse") or str(Path(sys.executable).with_name("torchft_lighthouse"))
    if not Path(exe).exists():
        extra, what, _ = TORCHFT
        raise missing_extra(extra, what, "torchft_lighthouse")
    port, host = port or free_port(), bind_host()
    quiet_rust()
    with open(log, "ab") as out:
        proc = subprocess.Popen([exe, "--min_replicas", str(cfg.min_replicas),
                                 "--bind", f"{url_host(host)}:{port}",
                                 "--join_timeout_ms", str(int(join_timeout_s(cfg) * 1000)),
                                 "--heartbeat_timeout_ms", str(int(cfg.heartbeat_timeout * 1000))],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=os.environ)
    deadline = time.monotonic() + ready_s
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return proc, f"http://{url_host(host)}:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise ConfigError(f"torchft's Lighthouse did not start (see {log}), so the elastic run "
                      "cannot begin.")


def run_elastic(cfg, argv: list[str], run: RunDir) -> int:
    """Run the replica groups to the end; the job's exit status."""
    server, address = lighthouse_process(cfg, run.logs / "lighthouse.log")
    lives = {g: 0 for g in range(cfg.replicas)}
    run.clear_group_records()  # (a resumed run's earlier part: its groups finish again)
    # the run's secret (a resumed run's: its own), its groups' only
    secret_file = secret.make(run.root / secret.FILE)

    began = {}  # each group's current life: when it was started (wall clock, as events are)

    def start(g: int) -> LocalJob:
        began[g] = time.time()
        # the group's lives, as torchrun counts them (checkpoint/lifecycle.py: restarted_group)
        env = {LIGHTHOUSE_ENV: address, REPLICA_ENV: str(g), RESTART_COUNT: str(lives[g]),
               LIFE_ENV: str(run.lighthouse_life), SECRET_ENV: str(secret_file)}
        return LocalJob(argv, cfg.shards, run, env, log_prefix=f"replica{g}-", terminal=g == 0,
                        node=(g * cfg.shards, cfg.world))

    jobs, finished = {g: start(g) for g in range(cfg.replicas)}, set()
    try:
        while jobs:
            if lighthouse_kill_asked(run.root):  # --kill lighthouse:STEP, as if its host were lost
                print("lowband: the Lighthouse was killed (--kill lighthouse).", file=sys.stderr,
                      flush=True)
                server.kill()
            if server.poll() is not None:
                server = restart_lighthouse(cfg, run, address)
                if server is None:
                    for job in jobs.values():
                        job.stop()
                    return 3
            for g, job in list(jobs.items()):
                if g not in jobs:  # stopped in this round (leave_out_stragglers)
                    continue
                result = job.poll()
                if result is None:
                    continue
                code, rank = result
                del jobs[g]
                if code == 0:
                    if not finished:  # the run's result exists: no live peer for a late group
                        lives_now = {j: began[j] for j in jobs}
                        restarted = {j for j in jobs if lives[j]}
                        for late, why in leave_out_stragglers(cfg, run, lives_now,
                                                              restarted).items():
                            jobs.pop(late).stop()
                            print(f"lowband: replica group {late} is stopped: {why}.",
                                  file=sys.stderr, flush=True)
                    finished.add(g)
                elif code in (2, 3, 130):  # bad input (every group would refuse it), a stop
                    # on purpose (no quorum, NaN: a restart would meet it again), or Ctrl-C
                    if code in (2, 3) and (g, rank) != (0, 0):  # its sentence is in its log
                        print(last_line(run.logs / f"replica{g}-rank{rank}.log"), file=sys.stderr)
                    for other in jobs.values():
                        other.stop()
                    return code
                elif finished:  # alone it would train on to a state of its own
                    print(f"lowband: replica group {g} {describe_exit(code)} (rank {rank}) and is "
                          "not restarted: a group has finished, so no live peer is left to heal "
                          "it.", file=sys.stderr, flush=True)
                elif lives[g] < cfg.max_restarts:
                    lives[g] += 1
                    print(f"lowband: replica group {g} {describe_exit(code)} (rank {rank}); "
                          f"restarting it (life {lives[g] + 1} of {cfg.max_restarts + 1}), the "
                          "others train on.", file=sys.stderr, flush=True)
                    jobs[g] = start(g)
                else:
                    print(f"lowband: replica group {g} {describe_exit(code)} (rank {rank}) and "
                          f"is not restarted again (--max-restarts {cfg.max_restarts}); the "
                          "others train on.", file=sys.stderr, flush=True)
            time.sleep(0.1)
    except KeyboardInterrupt:
        for job in jobs.values():
            job.stop()
        return 130
    finally:
        server.kill()
        server.wait()
    if not finished:
        raise ConfigError("every replica group was lost, so the run has no result: see "
                          f"{run.logs} and start it again.")
    summary.write_elastic(cfg, run)
    return 0


def restart_lighthouse(cfg, run: RunDir, address: str) -> subprocess.Popen | None:
    """A new Lighthouse on the dead one's port, its life written first (None: it did not start:
    the job stops). The pause lets every quorum the old one answered reach its group before
    the file says the next life, and lets the old port go. How long it was away (from its
    death seen, within the supervisor's 0.1 s poll, to the new one answering) is recorded."""
    t0 = time.monotonic()
    life = lighthouse_life(run.lighthouse_life) + 1
    time.sleep(1.0)
    write_json_atomic(run.lighthouse_life, life)
    try:
        server, _ = lighthouse_process(cfg, run.logs / "lighthouse.log",
                                       port=int(address.rsplit(":", 1)[1]))
    except ConfigError:
        print(f"lowband: the Lighthouse stopped and a new one did not start on {address} (see "
              f"{run.logs / 'lighthouse.log'}), so the groups stop; `lowband train --resume "
              f"{run.root}` continues them from their checkpoints.", file=sys.stderr, flush=True)
        return None
    down = (run.read_json(run.lighthouse_down) or []) + [round(time.monotonic() - t0, 3)]
    write_json_atomic(run.lighthouse_down, down)
    print(f"lowband: the Lighthouse stopped; a new one serves {address} (restart {life}, after "
          f"{down[-1]:.1f} s), and the groups' quorums wait for it.", file=sys.stderr, flush=True)
    return server


def leave_out_stragglers(cfg, run: RunDir, unfinished: dict[int, float],
                         restarted: set[int] = frozenset()) -> dict[int, str]:
    """Once a group has finished: the groups of `unfinished` (each with the wall-clock time its
    current life began, or 0: from its last `run` event) that have met no finished group in a
    quorum since then (restarted too late to heal), with why. No live peer is left to heal
    them, and alone they would train on to a state of their own (and write model.pt over the
    run's): the caller stops them, and the summary counts their work as lost (record_left_out).
    restarted: the groups whose current life is a restart (the reason says so: a life stopped
    before its first event leaves no other trace of its restart)."""
    done = set(run.group_records())
    if not done:
        return {}
    events = [e for e in read_events(run, ("run", "membership"))
              if e["rank"] % cfg.shards == 0 and e.get("replica") in unfinished]
    left = {}
    for g in sorted(set(unfinished) - done):
        mine = [e for e in events if e["replica"] == g]
        since = max([unfinished[g]] + [e["t"] for e in mine if e["kind"] == "run"
                                       and e.get("phase") in ("start", "resume")])
        if not any(e["kind"] == "membership" and e["t"] >= since and done & set(e["members"])
                   for e in mine):
            left[g] = (f"since it {'was restarted' if g in restarted else 'started'} it has "
                       "met no group that finished, so no live peer is left to heal it")
    record_left_out(run, left)
    return left


def record_left_out(run: RunDir, groups: dict[int, str]) -> None:
    """RUN/groups/left-out.json: each group left out at the end, and why (elastic_record)."""
    if groups:
        run.groups.mkdir(exist_ok=True)
        before = run.read_json(run.left_out) or {}
        write_json_atomic(run.left_out, {**before, **{str(g): why for g, why in groups.items()}})
