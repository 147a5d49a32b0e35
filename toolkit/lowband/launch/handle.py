"""A TorchX job of lowband's, as a LaunchHandle: status, logs, wait, cancel, its run directory.

Also the TorchX plumbing every job shares: one runner for this process (kept open until exit,
since closing it stops the local jobs it started) and the guard that keeps the kernel's signal
handlers. attach() makes a handle for a job submitted earlier.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import threading
import time
from pathlib import Path

from lowband.config import ConfigError
from lowband.options import needs_extra

LOCAL_SCHEDULERS = ("local_cwd", "local_docker")
TERMINAL = ("succeeded", "failed", "cancelled")
ROLE = "node"
TORCHX = ("launch", "lowband launch", "torchx")  # needs_extra's (extra, what, module)


def write_secret(run_dir: Path) -> None:
    """The run's secret (comm/membership/secret.py), in the run directory before the job starts: its spec
    names the file (job.launch), so the nodes read it from the filesystem they share with this
    machine; a resumed run keeps its own."""
    from lowband.comm.membership import secret

    try:
        secret.make(run_dir / secret.FILE)
    except OSError as e:
        raise ConfigError(f"lowband launch writes the run's secret into {run_dir} before it "
                          f"submits the job, and cannot ({e.strerror}): give a run directory on "
                          "a filesystem this machine shares with the nodes.") from None


# -- the runner ------------------------------------------------------------------------------------

_runner = None
_runner_lock = threading.Lock()


def _get_runner():
    """One TorchX runner for this process, never closed before exit: closing it (or letting it be
    collected) would stop the local jobs it started."""
    global _runner
    with _runner_lock:
        if _runner is None:
            from torchx.runner import get_runner

            _runner = get_runner()
            atexit.register(_close_runner)
        return _runner


def _close_runner() -> None:
    """At exit: stop the local jobs this process started (TorchX would do it while tearing the
    interpreter down, less tidily)."""
    if _runner is not None:
        try:
            _runner.close()
            # and let the schedulers go now, while logging still works for their __del__
            getattr(_runner, "_scheduler_instances", {}).clear()
        except Exception:
            pass


class _keep_signals:
    """TorchX's local scheduler installs SIGINT/SIGTERM handlers when it is created; put back the
    ones we had (a kernel's interrupt must stay a KeyboardInterrupt)."""

    def __enter__(self):
        self.main = threading.current_thread() is threading.main_thread()
        if self.main:
            self.saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def __exit__(self, *exc):
        if self.main:
            for s, h in self.saved.items():
                if h is not None:
                    signal.signal(s, h)


def _state_name(app_status) -> str:
    if app_status is None:
        return "unknown"
    name = app_status.state.name.lower()
    return {"submitted": "pending", "unsubmitted": "pending"}.get(name, name)


# Slurm's job states as lowband's (a requeued or preempted job comes back: pending)
_SLURM = {"PENDING": "pending", "CONFIGURING": "pending", "REQUEUED": "pending",
          "REQUEUE_FED": "pending", "REQUEUE_HOLD": "pending", "RESIZING": "pending",
          "SUSPENDED": "pending", "PREEMPTED": "pending", "RUNNING": "running",
          "COMPLETING": "running", "STAGE_OUT": "running", "SIGNALING": "running",
          "COMPLETED": "succeeded", "CANCELLED": "cancelled"}


def slurm_state(job_id: str) -> str:
    """A Slurm job's state, from the controller while it knows the job (squeue answers at once
    after sbatch; accounting may not have seen it yet), then from accounting (sacct). A
    heterogeneous job's components: running while any runs, failed if any failed (TorchX's own
    reading takes the last row, and stops at 'CANCELLED by 0')."""
    import subprocess

    def states(cmd):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return []
        return [line.split()[0] for line in out.stdout.splitlines() if line.strip()] \
            if out.returncode == 0 else []

    found = states(["squeue", "-h", "-j", job_id, "-o", "%T"]) or \
        states(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"])
    mine = [_SLURM.get(st, "failed") for st in found]
    for state in ("running", "pending", "failed", "cancelled"):
        if state in mine:
            return state
    return "succeeded" if mine else "unknown"


# -- the handle ------------------------------------------------------------------------------------

class LaunchHandle:
    """A lowband job submitted through TorchX (or ready to be, before start()).

    run_dir      the run directory (local path; for remote schedulers, as the nodes see it
                 relative to their working directory, which is this one on a shared filesystem)
    app_handle   TorchX's handle, e.g. local_cwd://torchx/lowband-x1y2 (None before start())
    dryrun_info  the request TorchX sends (print it: the sbatch script, the Kubernetes resource)
    status()     pending, running, succeeded, failed, cancelled, unknown (or 'not started')
    logs()       what the nodes printed so far;  wait(timeout)  blocks until the end
    cancel()     stops the job;  summary()  the run's summary.json once it is written
    Works as a Dashboard source: it has .run_dir, .start(), .status() and .cancel().
    """

    def __init__(self, runner, dryrun_info, run_dir: Path, scheduler: str, nnodes: int):
        self._runner, self.dryrun_info = runner, dryrun_info
        self.run_dir, self.scheduler, self.nnodes = Path(run_dir), scheduler, nnodes
        self.app_handle: str | None = None
        self._lock = threading.RLock()
        self._final: str | None = None

    @property
    def app_id(self) -> str | None:
        return self.app_handle.rsplit("/", 1)[-1] if self.app_handle else None

    def start(self) -> "LaunchHandle":
        """Submit the job (once; later calls do nothing)."""
        with self._lock:
            if self.app_handle is None:
                write_secret(self.run_dir)  # (the run directory with it)
                with _keep_signals():
                    self.app_handle = self._runner.schedule(self.dryrun_info)
        return self

    def status(self) -> str:
        with self._lock:
            if self.app_handle is None:
                return "not started"
            if self._final is not None:
                return self._final
            if self.scheduler == "slurm":
                state = slurm_state(self.app_id)
            else:
                state = _state_name(self._runner.status(self.app_handle))
            if state in TERMINAL:
                self._final = state
            return state

    @property
    def done(self) -> bool:
        return self.status() in TERMINAL

    def wait(self, timeout: float | None = None, interval: float = 0.5,
             unknown_timeout: float = 60.0, on_poll=None) -> str:
        """Block until the job ends; return its final status. TimeoutError if it runs longer,
        or if the scheduler does not know the job for unknown_timeout seconds on end (a remote
        scheduler's accounting may need a moment after submission: that is waited for).
        on_poll(): called at every look (lowband launch prints the new log lines)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        unknown_since = None
        while True:
            state = self.status()
            if on_poll is not None:
                on_poll()
            if state in TERMINAL or state == "not started":
                return state
            if state == "unknown":
                unknown_since = unknown_since or time.monotonic()
                if time.monotonic() - unknown_since >= unknown_timeout:
                    raise TimeoutError(
                        f"{self.app_handle} stayed unknown to {self.scheduler} for "
                        f"{unknown_timeout:g} s: check that the job exists and that the "
                        "scheduler reports it (on Slurm: squeue and sacct -j ID).")
            else:
                unknown_since = None
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{self.app_handle} is still {state} after {timeout:g} s; "
                                   "wait longer or cancel() it.")
            time.sleep(interval)

    def cancel(self) -> None:
        """Stop the job (its processes, for local schedulers). Nothing happens once it has ended."""
        with self._lock:
            if self.app_handle is None or self.status() in TERMINAL:
                return
            self._runner.cancel(self.app_handle)
            if self.scheduler in LOCAL_SCHEDULERS:
                self._final = "cancelled"

    def logs(self, node: int | None = None, tail: int | None = None) -> str:
        """What the nodes' agents and workers printed so far (every node, or one), last `tail`
        lines of each."""
        if self.app_handle is None:
            return ""
        nodes = range(self.nnodes) if node is None else [node]
        parts = []
        for k in nodes:
            text = self._node_log(k)
            lines = text.splitlines()
            if tail is not None:
                lines = lines[-tail:]
            if len(nodes) > 1:
                parts.append(f"== node {k} ==")
            parts.extend(lines)
        return "\n".join(parts) + ("\n" if parts else "")

    def log_files(self) -> list[Path]:
        """The files the nodes' output goes to: a local scheduler's, else the copies the node
        agents write to RUN/logs/node<k>.log (once the run directory is known and they exist)."""
        if self.scheduler not in LOCAL_SCHEDULERS:
            if self.run_dir is None:
                return []
            files = [self.run_dir / "logs" / f"node{k}.log" for k in range(self.nnodes)]
            return files if any(f.is_file() for f in files) else []
        log_dir = getattr(getattr(self.dryrun_info, "request", None), "log_dir", None)
        if not log_dir and self.app_handle:  # attached: the scheduler's ui_url is file://<dir>
            url = getattr(self._runner.status(self.app_handle), "ui_url", None) or ""
            log_dir = url[len("file://"):] if url.startswith("file://") else None
        if not log_dir:
            return []
        return [Path(log_dir) / ROLE / str(k) / "combined.log" for k in range(self.nnodes)]

    def _node_log(self, k: int) -> str:
        files = self.log_files()
        if files:
            try:
                return files[k].read_text(errors="replace")
            except OSError:
                return ""
        try:
            return "".join(line if line.endswith("\n") else line + "\n" for line in
                           self._runner.log_lines(self.app_handle, ROLE, k, should_tail=False))
        except Exception as e:  # a scheduler without logs, or a job gone from it
            return f"(no logs from {self.scheduler}: {e})\n"

    def summary(self) -> dict | None:
        from lowband.telemetry import RunDir

        if self.run_dir is None:
            return None
        run = RunDir(self.run_dir)
        return run.read_json(run.summary)

    def __repr__(self) -> str:
        return (f"LaunchHandle({self.app_handle or 'not started'}, run_dir='{self.run_dir}', "
                f"status={self.status()})")


def attach(app_handle: str, run_dir: str | os.PathLike | None = None) -> LaunchHandle:
    """A LaunchHandle for a job already submitted (e.g. a Slurm job from another session, or a
    local job of this process whose handle was dropped). run_dir: where it writes, if known."""
    needs_extra(*TORCHX)
    from torchx.specs import parse_app_handle

    scheduler = parse_app_handle(app_handle).scheduler_backend
    runner = _get_runner()
    with _keep_signals():
        app = runner.describe(app_handle)
    if app is None:
        raise ConfigError(f"{scheduler} knows no job {app_handle}: check the handle.")
    role = next((r for r in app.roles if r.name == ROLE), app.roles[0])
    if run_dir is None:  # as the job was given it, when the scheduler still has its command
        found = re.search(r"--run-dir '?([^ ']+)", " ".join(role.args))
        run_dir = found.group(1) if found and "$" not in found.group(1) else None
    handle = LaunchHandle(runner, None, Path(run_dir or "."), scheduler, role.num_replicas)
    handle.app_handle = app_handle
    if run_dir is None:
        handle.run_dir = None
    return handle

