"""`python -m lowband.launch lighthouse`: an elastic job's first role (component.py,
--elastic): torchft's Lighthouse, serving the replica groups' quorums, that also ends the job.
When every group has written its record (RUN/groups/, on the shared filesystem) it writes
summary.json and exits; a group lost for good never writes one, so once the first record is
there the others get --wait seconds before the summary is written from those that finished."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from lowband.faults import lighthouse_kill_asked
from lowband.launch.supervise import lighthouse, write_summary
from lowband.telemetry import RunDir


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m lowband.launch lighthouse",
                                allow_abbrev=False)
    p.add_argument("--port", type=int, default=29510)
    p.add_argument("--heartbeat-timeout", type=_positive, default=5.0,
                   help="seconds without a group's heartbeat before it is left out of a quorum")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--replicas", type=int, required=True, help="the run's replica groups")
    p.add_argument("--join-timeout", type=_positive, default=60.0,
                   help="seconds a quorum waits for a group that heartbeats but has not asked "
                   "(lowband.comm.elastic.join_timeout_s)")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--wait", type=float, default=600.0,
                   help="seconds the other groups get once the first has finished")
    a = p.parse_args(argv)
    server = lighthouse(a.min_replicas, a.join_timeout, port=a.port,
                        heartbeat_timeout_s=a.heartbeat_timeout)
    print(f"lowband: lighthouse at {server.address()} for {a.replicas} replica groups",
          file=sys.stderr, flush=True)
    run = RunDir(a.run_dir)
    first_done = None
    try:
        while True:
            done = len(list(run.groups.glob("replica*.json"))) if run.groups.is_dir() else 0
            if done and first_done is None:
                first_done = time.monotonic()
            if done >= a.replicas or (first_done and time.monotonic() - first_done > a.wait):
                break
            if lighthouse_kill_asked(run.root):  # --kill lighthouse:STEP: as if this host were lost
                print("lowband: the Lighthouse is stopped (--kill lighthouse).", file=sys.stderr)
                return 1
            time.sleep(1.0)
    finally:
        server.shutdown()
    from lowband.config import Config

    cfg = Config.from_file(str(Path(a.run_dir) / "config.json"))
    cfg.run_dir = a.run_dir
    write_summary(cfg, run)
    return 0


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive seconds, got {text!r}")
    return value
