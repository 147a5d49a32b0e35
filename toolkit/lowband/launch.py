"""Launch `lowband train` through TorchX: locally (local_cwd), on Slurm or on Kubernetes.

    h = lowband.launch(model="nano", steps=200)          # Python: returns a LaunchHandle at once
    h.status(); h.logs(); h.wait(600); h.cancel(); h.run_dir
    lowband launch -s slurm --gpu 8 --shards 8 --replicas 4 -- --algo streaming   # the CLI

Both build the job from the `train` component in launchers/lowband_components.py (also registered
as `lowband.train` for `torchx run`) and hand it to TorchX's runner. A local_cwd job's processes
belong to this Python process: they keep running after the call (and the notebook cell) returns,
and are stopped by `cancel()` or when this process exits.

`python -m lowband.launch torchrun ARGS` is the agent each node runs: torchrun, after checking
that the rendezvous can be reached, with one clear sentence instead of a traceback when a node
cannot reach it or not every node joins within the timeout.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import os
import re
import secrets
import signal
import socket
import sys
import threading
import time
import types
from pathlib import Path
from typing import Sequence

from lowband.config import ArgParser, ConfigError

LOCAL_SCHEDULERS = ("local_cwd", "local_docker")
TERMINAL = ("succeeded", "failed", "cancelled")
ROLE = "node"
_COMPONENTS_FILE = Path(__file__).resolve().parents[2] / "launchers" / "lowband_components.py"


# -- the component ---------------------------------------------------------------------------------

_components = None


def components():
    """The module of lowband's TorchX components (launchers/lowband_components.py).

    Also the target of the `torchx.components` entry point, so `torchx run lowband.train` finds it.
    """
    global _components
    if _components is None:
        path = Path(os.environ.get("LOWBAND_COMPONENTS", _COMPONENTS_FILE))
        if not path.is_file():
            raise ConfigError(f"lowband's TorchX components are not at {path}: install lowband "
                              "from its source tree (pip install -e .) or set LOWBAND_COMPONENTS "
                              "to the path of lowband_components.py.")
        spec = importlib.util.spec_from_file_location("lowband_components", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules.setdefault("lowband_components", module)
        spec.loader.exec_module(module)
        _components = module
    return _components


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
                if self.scheduler in LOCAL_SCHEDULERS:
                    self.run_dir.mkdir(parents=True, exist_ok=True)
                with _keep_signals():
                    self.app_handle = self._runner.schedule(self.dryrun_info)
        return self

    def status(self) -> str:
        with self._lock:
            if self.app_handle is None:
                return "not started"
            if self._final is not None:
                return self._final
            state = _state_name(self._runner.status(self.app_handle))
            if state in TERMINAL:
                self._final = state
            return state

    @property
    def done(self) -> bool:
        return self.status() in TERMINAL

    def wait(self, timeout: float | None = None, interval: float = 0.5) -> str:
        """Block until the job ends; return its final status. TimeoutError if it runs longer."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            state = self.status()
            if state in TERMINAL or state in ("not started", "unknown"):
                return state
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
        """The files a local scheduler writes the nodes' output to (empty for remote ones)."""
        if self.scheduler not in LOCAL_SCHEDULERS:
            return []
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


# -- launching -------------------------------------------------------------------------------------

def _flag_args(options: dict) -> list[str]:
    out = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


def _pop_flags(argv: list[str], names: Sequence[str]) -> tuple[list[str], dict]:
    """argv without `--name value` / `--name=value` for these names, and their (last) values."""
    rest, found, i = [], {}, 0
    while i < len(argv):
        tok = argv[i]
        name, eq, value = tok[2:].partition("=") if tok.startswith("--") else ("", "", "")
        if name in names:
            if eq:
                found[name] = value
            elif i + 1 < len(argv):
                found[name] = argv[i + 1]
                i += 1
            else:
                rest.append(tok)  # a flag without its value: the parser will say so
        else:
            rest.append(tok)
        i += 1
    return rest, found


def _check_flags(argv: list[str], remote: bool):
    """Parse and validate the `lowband train` flags here, before anything is submitted. For
    remote schedulers, data and config paths live on the cluster: checked there, not here."""
    from lowband.cli import train_parser
    from lowband.config import Config

    args = vars(train_parser().parse_args(argv))
    path = args.pop("config", None)
    if path and (not remote or Path(path).is_file()):
        cfg = Config.from_toml(path)
    else:
        cfg = Config()
    for key, value in args.items():
        setattr(cfg, key, value)
    data = cfg.data
    if remote and data != "builtin" and not Path(data).exists():
        cfg.data = "builtin"
    cfg.validate()
    cfg.data = data
    return cfg


def launch(flags: Sequence[str] = (), *, scheduler: str = "local_cwd", cfg: dict | None = None,
           algo: str | None = None, replicas: int | None = None, shards: int | None = None,
           run_dir: str | os.PathLike | None = None, config: str | None = None,
           replicas_per_node: int = 1, nnodes: int = 0, nproc_per_node: int = 0,
           name: str = "lowband", image: str | None = None, h: str | None = None, cpu: int = 2,
           gpu: int = 0, memMB: int = 4096, env: dict | None = None,
           mounts: Sequence[str] | None = None, rdzv_port: int = 0, rdzv_timeout: int = 300,
           max_retries: int = 0, progress: bool = False, start: bool = True,
           **options) -> LaunchHandle:
    """Run `lowband train` as a TorchX job and return its LaunchHandle at once.

    flags: `lowband train` flags as a list (["--model", "nano"]); options: the same as keywords
    (model="nano", steps=20, sync_every=4; True/False for on/off flags). scheduler: local_cwd,
    slurm, kubernetes or any TorchX scheduler; cfg: its run options (merged over .torchxconfig).
    The rest are the component's parameters (see launchers/lowband_components.py): by default
    one replica group per node. rdzv_port 0 picks a free port for local schedulers, 29500
    elsewhere. start=False returns the handle unsubmitted: inspect .dryrun_info, then start().
    Bad flags raise ConfigError with one sentence, before anything is submitted.
    """
    from torchx.runner.config import apply
    from torchx.specs.api import InvalidRunConfigException

    local = scheduler in LOCAL_SCHEDULERS
    # the component passes these itself: take them out of the pass-through flags
    flags, given = _pop_flags([*flags, *_flag_args(options)],
                              ("algo", "replicas", "shards", "run-dir", "config"))
    algo = algo if algo is not None else given.get("algo")
    config = config if config is not None else given.get("config")
    run_dir = run_dir if run_dir is not None else given.get("run-dir")
    argv = list(flags)
    for key, value in (("algo", algo), ("replicas", replicas if replicas is not None else
                                        given.get("replicas")),
                       ("shards", shards if shards is not None else given.get("shards")),
                       ("config", config)):
        if value is not None:
            argv += [f"--{key}", str(value)]
    train_cfg = _check_flags(argv, remote=not local)
    if run_dir is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run_dir = train_cfg.run_dir or os.path.join(
            "runs", f"{train_cfg.algo}-{stamp}-{secrets.token_hex(2)}")
    run_dir = str(run_dir)
    local_run_dir = Path(run_dir).resolve() if not os.path.isabs(run_dir) else Path(run_dir)
    if local:
        run_dir = str(local_run_dir)
    env = dict(env or {})
    if local:  # the nodes run this interpreter's python3 and torchrun, as the agent expects
        env["PATH"] = os.pathsep.join(p for p in (os.path.dirname(sys.executable),
                                                  env.get("PATH")) if p)
        if not rdzv_port:
            from lowband.local import free_port

            rdzv_port = free_port()
        # the local nodes share this machine's cores: no OpenMP threads spinning on them
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        app = components().train(
            *flags, algo=algo, replicas=train_cfg.replicas,
            shards=train_cfg.shards, replicas_per_node=replicas_per_node, nnodes=nnodes,
            nproc_per_node=nproc_per_node, run_dir=run_dir, config=config, name=name,
            h=h, cpu=cpu, gpu=gpu, memMB=memMB, env=env, mounts=list(mounts) if mounts else None,
            rdzv_port=rdzv_port or 29500, rdzv_timeout=rdzv_timeout, max_retries=max_retries,
            progress=progress, **({"image": image} if image else {}))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    run_cfg = dict(cfg or {})
    with _keep_signals():
        apply(scheduler, run_cfg)  # .torchxconfig in the home and working directories
    if local and "log_dir" not in run_cfg:
        run_cfg["log_dir"] = str(local_run_dir / "logs" / "torchx")
    runner = _get_runner()
    try:
        with _keep_signals():
            info = runner.dryrun(app, scheduler, cfg=run_cfg)
    except (InvalidRunConfigException, ValueError, KeyError) as e:
        raise ConfigError(f"TorchX's {scheduler} scheduler refused the job ({e}): give its run "
                          "options with cfg= (--scheduler-args K=V,...) or in .torchxconfig.")
    handle = LaunchHandle(runner, info, local_run_dir, scheduler, app.roles[0].num_replicas)
    return handle.start() if start else handle


# -- `lowband launch` ------------------------------------------------------------------------------

def launch_parser() -> argparse.ArgumentParser:
    p = ArgParser(prog="lowband launch", allow_abbrev=False, description=(
        "Run `lowband train` as a TorchX job: local_cwd here, or slurm, kubernetes, ... Every "
        "flag not listed here is a `lowband train` flag, passed through (e.g. --algo streaming "
        "--replicas 4 --model mini). By default each node holds one replica group (nnodes = "
        "replicas, nproc-per-node = shards). Local jobs are followed to the end (Ctrl-C cancels "
        "them); remote ones are submitted and their handle printed."),
        epilog="`python -m lowband.launch torchrun ARGS` is the per-node agent the job runs.")
    p.add_argument("-s", "--scheduler", default="local_cwd", help="TorchX scheduler (default: "
                   "local_cwd)")
    p.add_argument("--scheduler-args", "--cfg", default="", metavar="K=V,...",
                   help="scheduler run options, over .torchxconfig (e.g. partition=gpu,time=60)")
    p.add_argument("--nnodes", type=int, default=0, help="nodes (default: replicas / "
                   "replicas-per-node)")
    p.add_argument("--nproc-per-node", type=int, default=0, help="processes per node (default: "
                   "replicas-per-node x shards)")
    p.add_argument("--replicas-per-node", type=int, default=1, help="replica groups per node "
                   "(default: 1)")
    p.add_argument("--image", help="container image with lowband installed (kubernetes)")
    p.add_argument("--resource", dest="h", help="a TorchX named resource (instead of cpu/gpu/mem)")
    p.add_argument("--cpu", type=int, default=2, help="CPUs per node (default: 2)")
    p.add_argument("--gpu", type=int, default=0, help="GPUs per node (default: 0)")
    p.add_argument("--mem-mb", type=int, default=4096, dest="memMB", help="memory per node in "
                   "MB (default: 4096)")
    p.add_argument("--env", action="append", default=[], metavar="K=V[,K=V]",
                   help="environment variables of the workers")
    p.add_argument("--mount", action="append", default=[], metavar="type=bind,src=..,dst=..",
                   help="a mount for the nodes' containers")
    p.add_argument("--rdzv-port", type=int, default=0, help="rendezvous port on the first node "
                   "(default: 29500; a free one locally)")
    p.add_argument("--rdzv-timeout", type=int, default=300, help="seconds a node waits for the "
                   "rendezvous before it fails (default: 300)")
    p.add_argument("--name", default="lowband", help="job name (default: lowband)")
    p.add_argument("--max-retries", type=int, default=0)
    p.add_argument("--dryrun", action="store_true", help="print the request; submit nothing")
    p.add_argument("--wait", action="store_true", help="remote schedulers: wait for the end")
    return p


def _pairs(items: list[str], what: str) -> dict:
    out = {}
    for item in ",".join(items).split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{what} '{item}' is not KEY=VALUE.")
        out[key.strip()] = value
    return out


def main(argv: list[str]) -> int:
    if argv and argv[0] == "torchrun":
        return agent(argv[1:])
    args, train_flags = launch_parser().parse_known_args(argv)
    if "--" in train_flags:  # everything after it is lowband train's
        train_flags.remove("--")
    mounts = [tok for m in args.mount for tok in m.split(",") if tok]
    handle = launch(train_flags, scheduler=args.scheduler,
                    cfg=_pairs([args.scheduler_args], "scheduler option"),
                    replicas_per_node=args.replicas_per_node, nnodes=args.nnodes,
                    nproc_per_node=args.nproc_per_node, name=args.name, image=args.image,
                    h=args.h, cpu=args.cpu, gpu=args.gpu, memMB=args.memMB,
                    env=_pairs(args.env, "--env"), mounts=mounts, rdzv_port=args.rdzv_port,
                    rdzv_timeout=args.rdzv_timeout, max_retries=args.max_retries,
                    start=False)
    if args.dryrun:
        print(handle.dryrun_info)
        return 0
    handle.start()
    print(f"launched {handle.app_handle}\nrun directory: {handle.run_dir}", flush=True)
    if handle.scheduler not in LOCAL_SCHEDULERS and not args.wait:
        print(f"status: torchx status {handle.app_handle}\nlogs: torchx log {handle.app_handle}")
        return 0
    return _follow(handle)


def _follow(handle: LaunchHandle) -> int:
    """Print node 0's output as it comes, until the job ends; Ctrl-C cancels it."""
    files, offset = handle.log_files(), 0
    try:
        while True:
            state = handle.status()
            if files and files[0].is_file():
                with open(files[0], "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                offset += len(chunk)
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
            if state in TERMINAL or state == "unknown":
                break
            time.sleep(0.5)
    except KeyboardInterrupt:
        handle.cancel()
        print("lowband: interrupted; the job was cancelled.", file=sys.stderr)
        return 130
    if state != "succeeded":
        others = [handle.logs(node=k, tail=5) for k in range(1 if files else 0, handle.nnodes)]
        where = files[0].parents[2] if files else f"torchx log {handle.app_handle}"
        print("".join(f"(node {k}) {line}\n" for k, text in enumerate(others, 1 if files else 0)
                      for line in text.splitlines()) +
              f"lowband: error: {handle.app_handle} {state}; its logs: {where}", file=sys.stderr)
        return 1
    summary = handle.summary()
    if summary:
        from lowband.cli import one_line

        print(one_line(summary))
    return 0


# -- the node agent --------------------------------------------------------------------------------

def _is_this_host(host: str, conf: dict) -> bool:
    flag = conf.get("is_host")
    if flag is not None:
        return flag.lower() in ("1", "true", "yes", "y")
    try:  # torch's own test, so that we agree with it on who hosts the store
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

        return _matches_machine_hostname(host)
    except Exception:
        return host in ("localhost", "127.0.0.1", "::1", socket.gethostname())


def _wait_reachable(host: str, port: int, timeout: float) -> str | None:
    """None once host:port accepts a TCP connection; else why not, after `timeout` seconds."""
    deadline, why = time.monotonic() + timeout, "no answer"
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(min(left, 2.0), 0.1)):
                return None
        except socket.gaierror:
            why = f"{host} does not resolve"
        except OSError as e:
            why = e.strerror or str(e) or type(e).__name__
        if left <= 0:
            return why.lower()
        time.sleep(min(0.5, max(left, 0)))


def agent(argv: list[str]) -> int:
    """torchrun with a bounded, clear failure when the rendezvous cannot be reached or not every
    node joins it in time. A node never trains in a world of its own: the node count is fixed and
    the workers check that the world is replicas x shards."""
    # the agent's own C++ warnings (a peer agent's store closing first at the end of a failed
    # job prints a stack trace) stay quiet; the workers keep the level they would have had
    quiet = "TORCH_CPP_LOG_LEVEL" not in os.environ
    if quiet:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    import torch  # noqa: F401  (reads the level once, here)

    if quiet:
        del os.environ["TORCH_CPP_LOG_LEVEL"]
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import (RendezvousConnectionError,
                                                          RendezvousError,
                                                          RendezvousTimeoutError)
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    args = torchrun.parse_args(argv)
    _, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
    conf = dict(kv.split("=", 1) for kv in (args.rdzv_conf or "").split(",") if "=" in kv)
    timeout = float(conf.get("join_timeout", 600))
    host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)
    where = f"the rendezvous at {host}:{port}"
    me = socket.gethostname()
    if max_nodes > 1 and args.rdzv_backend == "c10d" and not _is_this_host(host, conf):
        why = _wait_reachable(host, port, timeout)
        if why is not None:
            print(f"lowband: error: this node ({me}) could not reach {where} within "
                  f"{timeout:g} s ({why}): check that the job's first node is running, that "
                  f"{host} resolves here and that port {port} is open between the nodes.",
                  file=sys.stderr, flush=True)
            return 3
    try:
        torchrun.main(argv)
    except RendezvousTimeoutError:
        print(f"lowband: error: not all {max_nodes} nodes joined {where} within {timeout:g} s "
              f"(this node: {me}): check that every node of the job started and that its rank-0 "
              "host variable names the first node.", file=sys.stderr, flush=True)
        return 3
    except RendezvousConnectionError:
        print(f"lowband: error: this node ({me}) lost or could not open its connection to "
              f"{where}: check that the job's first node is running and that port {port} is "
              "open between the nodes.", file=sys.stderr, flush=True)
        return 3
    except RendezvousError as e:
        print(f"lowband: error: {where} failed ({type(e).__name__}: {e}); the job's other nodes "
              "may have stopped.", file=sys.stderr, flush=True)
        return 3
    except ChildFailedError as e:
        if all(f.exitcode == 2 for f in e.failures.values()):
            return 2  # lowband's bad-input status: the workers said why in one sentence
        print(e, file=sys.stderr, flush=True)
        return 1
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


class _CallableModule(types.ModuleType):
    """`lowband.launch` is this module and the function both: `import lowband.launch` would
    otherwise replace the function `lowband.launch` with the module."""

    def __call__(self, *args, **kwargs) -> LaunchHandle:
        return launch(*args, **kwargs)


_CallableModule.__call__.__doc__ = launch.__doc__
sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except ConfigError as e:
        print(f"lowband: error: {e}", file=sys.stderr)
        sys.exit(2)
