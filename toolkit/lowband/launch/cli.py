"""`lowband launch`: its flags, and following a local job's output to the end.

`python -m lowband.launch torchrun ARGS` goes on to the node agent (node.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from lowband.comm.membership.elastic import ElasticOptions
from lowband.config import ArgParser, ConfigError, RunOptions, flag
from lowband.launch.handle import LOCAL_SCHEDULERS, LaunchHandle
from lowband.launch.env import ELASTIC_VARS
from lowband.launch.job import flag_args, launch
from lowband.launch.node import agent
from lowband.options import REPLICAS_ENV, RUN_DIR_ENV, SHARDS_ENV
from lowband.summary import one_line


def launch_parser() -> argparse.ArgumentParser:
    p = ArgParser(prog="lowband launch", description=(
        "Run `lowband train` as a TorchX job: local_cwd here, or slurm, kubernetes, ... Every "
        "flag not listed here is a `lowband train` flag, passed through (e.g. --algo streaming "
        "--replicas 4 --model mini). By default each node holds one replica group (nnodes = "
        "replicas, nproc-per-node = shards). Local jobs are followed to the end (Ctrl-C cancels "
        "them); remote ones are submitted and their handle printed. With --script PATH, every "
        "rank runs your training script instead, and the flags not listed here (and all after "
        f"--) are the script's; it reads the layout from {REPLICAS_ENV}, {SHARDS_ENV} and "
        f"{RUN_DIR_ENV} (lowband.launch.launch_config()); with --elastic too, its lowband.Sync "
        "runs elastic (docs/elastic.md)."),
        epilog="`python -m lowband.launch torchrun ARGS` is the per-node agent the job runs.")
    p.add_argument("-s", "--scheduler", default="local_cwd", help="TorchX scheduler (default: "
                   "local_cwd)")
    p.add_argument("--scheduler-args", "--cfg", default="", metavar="K=V,...",
                   help="scheduler run options, over .torchxconfig (e.g. partition=gpu,time=60)")
    p.add_argument("--script", metavar="PATH", help="run this training script on every rank "
                   "instead of `lowband train` (a path here for local_cwd, on the nodes otherwise)")
    p.add_argument("--elastic", action="store_true", default=None, help="each replica group a "
                   "role of its own joined by a torchft Lighthouse, restarted when it dies "
                   "(docs/elastic.md); with --script, a script that trains through lowband.Sync")
    # lowband train's own options, declared once (ElasticOptions, RunOptions): the job's with
    # --script, passed through to `lowband train` without one
    run = {f.name: f for f in dataclasses.fields(RunOptions)}
    for f in (*(f for f in dataclasses.fields(ElasticOptions) if f.name != "elastic"),
              run["replicas"], run["shards"]):
        what = f"--elastic: {f.metadata['help']}" if f.name not in run else f.metadata["help"]
        p.add_argument(flag(f.name), type=f.metadata["type"], metavar=f.name.upper(),
                       help=f"{what} (default: lowband train's, {f.default!r})")
    p.add_argument("--run-dir", help="run directory, on a filesystem every node shares (default: "
                   "runs/<algo or script>-<time>-<xxxx>)")
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
    p.add_argument("--bind", metavar="INTERFACE_OR_ADDRESS", help="the interface (eth0) or "
                   "address every listener of the job binds on its node: the site link "
                   "(default: the interface that routes to the first node; loopback for "
                   "local_cwd; never every interface)")
    p.add_argument("--doctor", action="store_true", help="each node first runs `lowband doctor` "
                   "with the others: a failed check (the rendezvous, ports, names, the secret) "
                   "ends the job in one sentence before any training process starts; the first "
                   "node's log has the measured link and the plan on it (docs/doctor.md)")
    p.add_argument("--name", default="lowband", help="job name (default: lowband)")
    p.add_argument("--max-retries", type=int, default=0)
    p.add_argument("--requeue", type=int, nargs="?", const=300, metavar="SECONDS",
                   help="slurm: SECONDS (default 300) before the job's time limit, every rank "
                   "stops at one step and writes a checkpoint, and the job requeues itself to "
                   "continue from it (docs/faults.md)")
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
    if argv and argv[0] == "lighthouse":  # an elastic job's first role
        from lowband.launch.lighthouse import main as lighthouse

        return lighthouse(argv[1:])
    args, train_flags = launch_parser().parse_known_args(argv)
    if "--" in train_flags:  # everything after it is lowband train's (or the script's)
        train_flags.remove("--")
    mounts = [tok for m in args.mount for tok in m.split(",") if tok]
    # --elastic and its options: the job's with a script, `lowband train`'s flags without one
    elastic = {k: v for k in ELASTIC_VARS if (v := getattr(args, k)) is not None}
    if args.script is not None:
        train_flags, script_args = [], train_flags
    else:
        train_flags, script_args, elastic = [*flag_args(elastic), *train_flags], [], {}
    handle = launch(train_flags, scheduler=args.scheduler, script=args.script,
                    script_args=script_args, replicas=args.replicas, shards=args.shards,
                    run_dir=args.run_dir,
                    cfg=_pairs([args.scheduler_args], "scheduler option"),
                    replicas_per_node=args.replicas_per_node, nnodes=args.nnodes,
                    nproc_per_node=args.nproc_per_node, name=args.name, image=args.image,
                    h=args.h, cpu=args.cpu, gpu=args.gpu, memMB=args.memMB,
                    env=_pairs(args.env, "--env"), mounts=mounts, rdzv_port=args.rdzv_port,
                    rdzv_timeout=args.rdzv_timeout, max_retries=args.max_retries,
                    bind=args.bind, requeue=args.requeue, doctor=args.doctor, start=False,
                    **elastic)
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
    offset = 0

    def show():
        nonlocal offset
        files = handle.log_files()  # a remote job's appear once its nodes start
        if files and files[0].is_file():
            with open(files[0], "rb") as f:
                f.seek(offset)
                chunk = f.read()
            offset += len(chunk)
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()

    try:
        state = handle.wait(on_poll=show)
        show()
    except KeyboardInterrupt:
        handle.cancel()
        print("lowband: interrupted; the job was cancelled.", file=sys.stderr)
        return 130
    except TimeoutError as e:
        print(f"lowband: error: {e}", file=sys.stderr)
        return 1
    if state != "succeeded":
        # the nodes' own sentences (a node agent names the failed worker, its rank and log;
        # a worker its error), else the last lines of each node's log
        said = [line[line.index("lowband: "):] for k in range(handle.nnodes)
                for line in handle.logs(node=k).splitlines() if "lowband: " in line]
        lines = list(dict.fromkeys(said)) or [
            f"(node {k}) {line}" for k in range(handle.nnodes)
            for line in handle.logs(node=k, tail=5).splitlines()]
        logs = handle.run_dir / "logs" if handle.run_dir is not None else None
        where = logs if logs is not None and logs.is_dir() else f"torchx log {handle.app_handle}"
        print("".join(line + "\n" for line in lines) +
              f"lowband: error: {handle.app_handle} {state}; its logs: {where}", file=sys.stderr)
        return 1
    summary = handle.summary()
    if summary:
        print(one_line(summary))
    return 0
