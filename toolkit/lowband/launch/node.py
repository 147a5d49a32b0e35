"""The node agent, `python -m lowband.launch torchrun ARGS`: torchrun behind a rendezvous check.

Each node of a job runs it (component.py): it waits, bounded, for the first
node's rendezvous to accept connections, then runs torchrun, and turns torchrun's rendezvous
failures into one sentence and an exit status instead of a traceback. A worker that fails is
named in one sentence: the node, its global rank, how it ended and the node's log. With the
job's run directory and node name in its environment (LOWBAND_RUN_DIR, LOWBAND_NODE), the agent
also copies everything the node prints (its own lines, torchrun's, the workers') to
RUN/logs/<node>.log, whatever the scheduler does with its output. Its stores and its workers'
listeners bind the node's bind address (comm/membership/bind.py: --bind, else the interface that routes
to the rendezvous host), never every interface.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from lowband.comm.membership.bind import bind_host, bound_store_type
from lowband.options import BIND_ENV, NODE_ENV, NODE_LOG_ENV, PREEMPTED, RUN_DIR_ENV, ConfigError


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
    run_dir, node = os.environ.get(RUN_DIR_ENV), os.environ.get(NODE_ENV)
    if run_dir and node and NODE_LOG_ENV not in os.environ:
        return _tee(argv, Path(run_dir) / "logs" / f"{node}.log")
    return _agent(argv)


def _tee(argv: list[str], log: Path) -> int:
    """Run the agent as a child whose stdout and stderr go both where ours go and to `log`
    (appended: a requeued job's attempts follow each other). Signals are passed on."""
    log.parent.mkdir(parents=True, exist_ok=True)
    child = subprocess.Popen([sys.executable, "-m", "lowband.launch", "torchrun", *argv],
                             env={**os.environ, NODE_LOG_ENV: str(log)}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    lock = threading.Lock()
    with open(log, "ab") as out:
        def copy(pipe, to):
            for line in iter(pipe.readline, b""):
                with lock:
                    to.write(line)
                    to.flush()
                    out.write(line)
                    out.flush()

        threads = [threading.Thread(target=copy, args=(child.stdout, sys.stdout.buffer)),
                   threading.Thread(target=copy, args=(child.stderr, sys.stderr.buffer))]
        for t in threads:
            t.start()
        code = child.wait()
        for t in threads:
            t.join()
    return code if code >= 0 else 128 - code


def _agent(argv: list[str]) -> int:
    # the agent's own C++ warnings (a peer agent's store closing first at the end of a failed
    # job prints a stack trace) stay quiet; the workers keep the level they would have had
    quiet = "TORCH_CPP_LOG_LEVEL" not in os.environ
    if quiet:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    import torch  # noqa: F401  (reads the level once, here)

    if quiet:
        del os.environ["TORCH_CPP_LOG_LEVEL"]
    import torch.distributed as dist
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous
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
    # every store this agent serves (the rendezvous's, the workers' shared one) listens on the
    # node's bind address (the route to the rendezvous host unless --bind or a Lighthouse says),
    # which the workers inherit and torchrun names them as their store's (--local-addr)
    try:
        address = os.environ[BIND_ENV] = bind_host(peer=host)
    except ConfigError as e:
        print(f"lowband: error: {e}", file=sys.stderr, flush=True)
        return 2
    if args.local_addr is None:
        argv = ["--local-addr", address, *argv]
    # SIGUSR1 too (Slurm's warning before a time limit) is passed on to the workers, which stop
    # at one step after a checkpoint (checkpoint/preempt.py); torchrun gives them its
    # --shutdown_timeout (30 s) before it kills them
    if getattr(args, "signals_to_handle", None) == "SIGTERM,SIGINT,SIGHUP,SIGQUIT":
        argv = ["--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", *argv]
    bound = bound_store_type()
    for module in (dist, c10d_rendezvous_backend, static_tcp_rendezvous):
        module.TCPStore = bound  # (this agent process only: its workers are processes of their own)
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
        if all(f.exitcode == PREEMPTED for f in e.failures.values()):
            return PREEMPTED  # stopped by a signal after a checkpoint, as rank 0 said
        print(e, file=sys.stderr, flush=True)
        print(failure_sentence(e.failures, me), file=sys.stderr, flush=True)
        return 1
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


def failure_sentence(failures: dict, host: str) -> str:
    """One sentence for the workers of this node that failed (global rank -> ProcessFailure):
    the node, the first failed rank, how it ended, and where the node's output is."""
    from lowband.launch.local import describe_exit

    rank, failure = min(failures.items())
    node = os.environ.get(NODE_ENV, "this node")
    log = os.environ.get(NODE_LOG_ENV)
    more = f" (and {len(failures) - 1} more of its workers)" if len(failures) > 1 else ""
    return (f"lowband: error: {node} ({host}): worker rank {rank} {describe_exit(failure.exitcode)}"
            f"{more}, so the job stopped" + (f"; its log: {log}." if log else "."))
