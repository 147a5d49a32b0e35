"""`lowband train --elastic` on one machine: a torchft Lighthouse and R replica groups, each a
job of its own (S local workers, launch.local.LocalJob), restarted when it dies.

The Lighthouse is torchft's own program (`torchft_lighthouse`), a process of its own whose
output goes to RUN/logs/lighthouse.log; every worker finds it through TORCHFT_LIGHTHOUSE, and
its group through LOWBAND_REPLICA (comm/elastic.py). A group that dies (a killed node, a crash)
is started again, up to --max-restarts times: it heals from a live peer at the others' next
sync and trains on. A group that refuses its input (status 2) or stops on purpose (3: no
quorum, as when the Lighthouse is lost) stops the whole job: the others would meet it too. When
every group has finished or is lost for good, the groups' records (RUN/groups/) become
summary.json.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
import socket
import subprocess
import sys
import time
from pathlib import Path

from lowband.comm.elastic import LIGHTHOUSE_ENV, REPLICA_ENV, TORCHFT, quiet_rust
from lowband.faults import lighthouse_kill_asked
from lowband.launch.local import LocalJob, describe_exit, free_port, last_line
from lowband.options import ConfigError, missing_extra, needs_extra
from lowband.summary import add_ddp_bytes, summarize
from lowband.telemetry import RunDir, read_events, write_json_atomic



def lighthouse(min_replicas: int, join_timeout_s: float = 10.0, port: int = 0):
    """torchft's Lighthouse, serving in this process (port 0: a free one)."""
    quiet_rust()
    needs_extra(*TORCHFT)
    from torchft._torchft import LighthouseServer

    return LighthouseServer(bind=f"[::]:{port}", min_replicas=min_replicas,
                            join_timeout_ms=int(join_timeout_s * 1000))


def lighthouse_process(min_replicas: int, log: Path, join_timeout_s: float = 10.0,
                       ready_s: float = 30.0) -> tuple[subprocess.Popen, str]:
    """torchft's Lighthouse program on a free local port, and its address once it answers."""
    exe = shutil.which("torchft_lighthouse") or str(Path(sys.executable).with_name("torchft_lighthouse"))
    if not Path(exe).exists():
        extra, what, _ = TORCHFT
        raise missing_extra(extra, what, "torchft_lighthouse")
    port = free_port()
    quiet_rust()
    with open(log, "ab") as out:
        proc = subprocess.Popen([exe, "--min_replicas", str(min_replicas), "--bind", f"[::]:{port}",
                                 "--join_timeout_ms", str(int(join_timeout_s * 1000))],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=os.environ)
    deadline = time.monotonic() + ready_s
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://localhost:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise ConfigError(f"torchft's Lighthouse did not start (see {log}), so the elastic run "
                      "cannot begin.")


def run_elastic(cfg, argv: list[str], run: RunDir) -> int:
    """Run the replica groups to the end; the job's exit status."""
    server, address = lighthouse_process(cfg.min_replicas, run.logs / "lighthouse.log")
    lives = {g: 0 for g in range(cfg.replicas)}

    def start(g: int) -> LocalJob:
        env = {LIGHTHOUSE_ENV: address, REPLICA_ENV: str(g)}
        return LocalJob(argv, cfg.shards, run, env, log_prefix=f"replica{g}-", terminal=g == 0,
                        node=(g * cfg.shards, cfg.world))

    jobs, finished = {g: start(g) for g in range(cfg.replicas)}, set()
    try:
        while jobs:
            if lighthouse_kill_asked(run.root):  # --kill lighthouse:STEP, as if its host were lost
                print("lowband: the Lighthouse was killed (--kill lighthouse).", file=sys.stderr,
                      flush=True)
                server.kill()
            for g, job in list(jobs.items()):
                result = job.poll()
                if result is None:
                    continue
                code, rank = result
                del jobs[g]
                if code == 0:
                    finished.add(g)
                elif code in (2, 3, 130):  # bad input (every group would refuse it), a stop
                    # on purpose (no quorum, NaN: a restart would meet it again), or Ctrl-C
                    if code in (2, 3) and (g, rank) != (0, 0):  # its sentence is in its log
                        print(last_line(run.logs / f"replica{g}-rank{rank}.log"), file=sys.stderr)
                    for other in jobs.values():
                        other.stop()
                    return code
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
    write_summary(cfg, run)
    return 0


def write_summary(cfg, run: RunDir) -> dict:
    """summary.json from the groups that finished, with how many times each was restarted
    (its lives: the `run` events with phase start of its first rank, less one)."""
    records = [run.read_json(p) for p in sorted(run.groups.glob("replica*.json"))]
    records = [r for r in records if r]
    ranks = [rank for r in records for rank in r["ranks"]]
    summary = summarize(cfg, ranks)
    add_ddp_bytes(summary, records[0]["ddp_one_step"], len(records))
    lives = Counter(e["replica"] for e in read_events(run, ("run",))
                    if e.get("phase") == "start" and e["rank"] % cfg.shards == 0)
    summary["elastic"] = {"groups_finished": sorted({r["replica"] for r in ranks}),
                          "restarts": {str(g): n - 1 for g, n in sorted(lives.items()) if n > 1}}
    write_json_atomic(run.summary, summary)
    return summary
