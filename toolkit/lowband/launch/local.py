"""Start R x S worker processes on this machine, watch them, stop them all if one fails.

Workers get torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1,
MASTER_PORT) and LOWBAND_BIND_HOST=127.0.0.1 (on test hosts: the host's address; comm/membership/bind.py),
so the worker code path is the same as under torchrun or TorchX. With `hosts`
(lowband.launch.hosts's test hosts: network namespaces joined by a shaped link), replica i's
ranks run on host i instead, meeting at host 0's address over the hosts' link. Rank 0 writes
to this terminal; the other ranks write to <run>/logs/rank<r>.log. If any worker exits with an
error, the others are killed and the job exits with that worker's status. SIGTERM and SIGUSR1
are passed on to the workers, which stop together after a checkpoint (checkpoint/preempt.py).
A worker whose collective failed because another had died ends without a traceback (peer_lost,
quiet_end) and is never named the cause; a worker's refusal under torchrun is also written to
torchrun's error file (tell_agent), so that torchrun's closing summary names it.
Workers die with this process (PR_SET_PDEATHSIG), so no process is left behind.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from lowband.comm.membership.bind import LOOPBACK
from lowband.options import BIND_ENV, PREEMPT_SIGNALS, PREEMPTED, WORKER_ENV
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


PEER_LOST = 75  # the exit status of a worker whose collective failed because a peer had gone
_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe",
         "remote worker crashing")  # gloo's words for a peer whose process ended


def describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    if code == PEER_LOST:
        return "lost its connection to the other workers"
    return f"exited with status {code}"


def peer_lost(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it was raised from) is a collective's failure because
    another worker went away: torch's DistBackendError or DistNetworkError, or a RuntimeError in
    gloo's words for a closed connection. It is expected on the workers that outlive a dead one,
    so they end quietly (quiet_end); any other exception is a bug and keeps its traceback."""
    from torch.distributed import DistBackendError, DistNetworkError

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (DistBackendError, DistNetworkError)):
            return True
        if isinstance(exc, RuntimeError) and any(w in str(exc).lower() for w in _GONE):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def quiet_end(exc: BaseException) -> int:
    """A worker's end after a peer went away (peer_lost): exit status PEER_LOST, with one line
    instead of a traceback in its own log or under torchrun; nothing on the terminal that
    `lowband train` shares with rank 0, where the launcher's sentence names the worker that
    died and its log (train_here) and should be read first."""
    import stat

    shared_terminal = os.environ.get(WORKER_ENV) and not stat.S_ISREG(os.fstat(2).st_mode)
    if not shared_terminal:
        detail = re.sub(r"^\[[^]]*\]\s*", "", (str(exc).strip().splitlines() or [""])[0])
        detail = detail.split(". ")[0][:160]  # gloo's: "[pair.cc:537] Read error [...]: ..."
        print(f"lowband: worker rank {os.environ.get('RANK', '?')} stopped: another worker went "
              f"away during a collective ({type(exc).__name__}: {detail})", file=sys.stderr)
    return PEER_LOST


def tell_agent(sentence: str) -> None:
    """Under torchrun (TORCHELASTIC_ERROR_FILE in the environment, a file per worker): write the
    worker's one sentence there, in the JSON torch.distributed.elastic's error files hold, so that
    the failure summary torchrun prints last names lowband's sentence ("traceback : lowband:
    error: ...") rather than a link to torch's docs."""
    import json

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": {"message": sentence, "extraInfo": {
        "py_callstack": sentence, "timestamp": str(int(time.time()))}}}
    try:
        Path(path).write_text(json.dumps(record))
    except OSError:  # the summary then says what it would have said
        pass


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
        if failed and all(codes[r] in (2, 3, PREEMPTED) for r in failed) and None in codes:
            # a sentence decided on rank 0 stops every rank with it (decided_by_rank0): the
            # others get a moment to stop by themselves, so that rank 0's is the one told
            self._stopping_since = self._stopping_since or time.monotonic()
            if time.monotonic() - self._stopping_since < 3.0:
                return None
        if failed:
            # the cause: a worker killed from outside, else one that refused input or stopped
            # on purpose (2, 3); the others usually fail after it because their peer vanished
            # (PEER_LOST, quiet_end: never the cause while another failed)
            rank_of = {-signal.SIGKILL: 0, -signal.SIGTERM: 0, 2: 1, 3: 1, PREEMPTED: 1,
                       PEER_LOST: 3}
            first = min(failed, key=lambda r: (rank_of.get(codes[r], 2), r))
            self.stop()
            self.close()
            return codes[first], first
        if all(c == 0 for c in codes):
            self.close()
            return 0, None
        return None

    def wait(self) -> tuple[int, int | None]:
        """Block until every worker is done or one fails. Returns (status, failed rank).
        SIGTERM and SIGUSR1 meanwhile are passed on to the workers (`forward`)."""
        saved = {}
        if threading.current_thread() is threading.main_thread():
            saved = {sig: signal.signal(sig, lambda s, _f: self.forward(s))
                     for sig in (getattr(signal, name) for name in PREEMPT_SIGNALS)}
        try:
            while (result := self.poll()) is None:
                time.sleep(0.1)
            return result
        except KeyboardInterrupt:
            self.stop()
            self.close()
            return 130, None
        finally:
            for sig, before in saved.items():
                signal.signal(sig, before)

    def forward(self, sig: int) -> None:
        """SIGTERM or SIGUSR1 to every worker still running: they stop together after one step
        and a checkpoint, and say so (checkpoint/preempt.py); this job waits for them."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(sig)

    def close(self) -> None:
        for f in self._logs:
            if f is not None and not f.closed:
                f.close()

    def stop(self) -> None:
        """Kill the workers still running: SIGTERM would ask them for a checkpointed stop
        (checkpoint/preempt.py), which those of a failed job, waiting on a peer gone, or of an
        interrupted one, are not to make."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
