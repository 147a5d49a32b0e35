"""Start R x S worker processes on this machine, watch them, stop them all if one fails.

Workers get torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1,
MASTER_PORT) and LOWBAND_BIND_HOST=127.0.0.1 (on test hosts: the host's address; comm/membership/bind.py),
so the worker code path is the same as under torchrun or TorchX. With `hosts`
(lowband.launch.hosts's test hosts: network namespaces joined by a shaped link), replica i's
ranks run on host i instead, meeting at host 0's address over the hosts' link. Rank 0 writes
to this terminal; the other ranks write to <run>/logs/rank<r>.log. If any worker exits with an
error, the others are terminated (then killed) and the job exits with that worker's status.
Workers die with this process (PR_SET_PDEATHSIG), so no process is left behind.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from lowband.comm.membership.bind import LOOPBACK
from lowband.options import BIND_ENV, WORKER_ENV
from lowband.telemetry import RunDir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


class LocalJob:
    def __init__(self, argv: list[str], world: int, run: RunDir, env: dict | None = None,
                 log_prefix: str = "", terminal: bool = True, node: tuple[int, int] | None = None,
                 hosts=None, shards: int = 1):
        """log_prefix names the logs (an elastic group's: replica<i>-); terminal: rank 0
        writes to this terminal (else to its log as the others do); node: (this job's first
        local rank, processes on this machine) when several jobs share it (elastic groups), so
        that threads and devices are shared out among all of them; hosts: test hosts (with
        exec_prefix(i), addrs, devs), rank r on host r // shards (its replica's)."""
        first, on_node = node or (0, world)
        self.run, self.world = run, world
        port = free_port()
        master = "127.0.0.1" if hosts is None else hosts.addrs[0]
        self.procs: list[subprocess.Popen] = []
        self._logs = []
        self._stopping_since: float | None = None  # when a worker first stopped with 2 or 3
        for r in range(world):
            wenv = {**os.environ, **(env or {}), "RANK": str(r), "WORLD_SIZE": str(world),
                    "LOCAL_RANK": str(first + r), "LOCAL_WORLD_SIZE": str(on_node), "GROUP_RANK": "0",
                    "MASTER_ADDR": master, "MASTER_PORT": str(port), WORKER_ENV: "1",
                    BIND_ENV: LOOPBACK}  # one machine: every listener on loopback (comm/membership/bind.py)
            prefix = []
            if hosts is not None:  # its listeners and gloo on the host's link, not loopback
                prefix = hosts.exec_prefix(r // shards)
                wenv[BIND_ENV] = hosts.addrs[r // shards]
                wenv["GLOO_SOCKET_IFNAME"] = hosts.devs[r // shards]
            to_terminal = r == 0 and terminal
            out = None if to_terminal else open(run.logs / f"{log_prefix}rank{r}.log", "a")
            self._logs.append(out)
            cmd = [*prefix, sys.executable, "-m", "lowband.cli", "train", *argv, "--run-dir",
                   str(run.root)]
            self.procs.append(subprocess.Popen(cmd, env=wenv, stdout=out, stderr=out,
                                               stdin=subprocess.DEVNULL,
                                               preexec_fn=_die_with_parent))

    def poll(self) -> tuple[int, int | None] | None:
        """None while the workers run; (0, None) when all are done; (status, rank) of the
        cause when one failed, after stopping the others."""
        codes = [p.poll() for p in self.procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed and all(codes[r] in (2, 3) for r in failed) and None in codes:
            # a sentence decided on rank 0 stops every rank with it (decided_by_rank0): the
            # others get a moment to stop by themselves, so that rank 0's is the one told
            self._stopping_since = self._stopping_since or time.monotonic()
            if time.monotonic() - self._stopping_since < 3.0:
                return None
        if failed:
            # the cause: a worker killed from outside, else one that refused input or stopped
            # on purpose (2, 3); the others usually fail after it because their peer vanished
            # (often with SIGABRT from gloo's teardown)
            rank_of = {-signal.SIGKILL: 0, -signal.SIGTERM: 0, 2: 1, 3: 1}
            first = min(failed, key=lambda r: (rank_of.get(codes[r], 2), r))
            self.stop()
            self.close()
            return codes[first], first
        if all(c == 0 for c in codes):
            self.close()
            return 0, None
        return None

    def wait(self) -> tuple[int, int | None]:
        """Block until every worker is done or one fails. Returns (status, failed rank)."""
        try:
            while (result := self.poll()) is None:
                time.sleep(0.1)
            return result
        except KeyboardInterrupt:
            self.stop()
            self.close()
            return 130, None

    def close(self) -> None:
        for f in self._logs:
            if f is not None and not f.closed:
                f.close()

    def stop(self, grace_s: float = 5.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.time() + grace_s
        for p in self.procs:
            try:
                p.wait(timeout=max(deadline - time.time(), 0.01))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
