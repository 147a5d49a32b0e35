"""lowband's TorchX component, `train`: what lowband.launch() submits, and what TorchX runs as
`lowband.train` (registered through the `torchx.components` entry point, so an installed wheel
has it; launchers/lowband_components.py re-exports it for `torchx run` by path).

    torchx run lowband.train --replicas 4 --shards 2 -- --algo streaming    # registered name
    torchx run launchers/lowband_components.py:train --replicas 2 -- --model nano --steps 20
    torchx run -s slurm lowband.train --replicas 4 --gpu 8 --shards 8 --run_dir /shared/runs/a

`train` builds on `torchx.components.dist.ddp`: one torchrun agent per node, c10d rendezvous on
port `rdzv_port` of the first node (its address comes from the scheduler's rank-0 host variable),
`nproc_per_node` worker processes per node, each running `lowband train` as one rank, or with
`--script PATH` the user's own training script (its arguments after `--`), which reads the layout
from the workers' environment: LOWBAND_REPLICAS, LOWBAND_SHARDS, LOWBAND_RUN_DIR and
LOWBAND_PROGRESS (lowband.launch.layout() and launch_config() read them back).

Replicas to nodes: global rank r is shard r % S of replica r // S, and torchrun numbers ranks node
by node, so node n holds ranks n*P .. n*P+P-1 (P = nproc_per_node). By default each node holds
exactly one replica group (nnodes = replicas, nproc_per_node = shards): the slow link lowband
economises on is the one between nodes, the fast inner link stays inside a node.
`replicas_per_node` packs k replica groups on each node (nnodes = replicas / k, nproc_per_node =
k * shards); `nnodes` and `nproc_per_node` set the layout outright. Either way
nnodes x nproc_per_node must equal replicas x shards.

(Annotations use typing.List/Dict/Optional: TorchX 0.7's component linter wants them.)
"""

from typing import Dict, List, Optional, Tuple

import torchx.specs as specs
from torchx.components import dist
from torchx.specs import macros

from lowband.comm.membership.bind import check_bind
from lowband.comm.membership.secret import FILE as SECRET_FILE
from lowband.launch.env import ELASTIC_VARS, LAYOUT_ENV
from lowband.options import (BIND_ENV, LIGHTHOUSE_ENV, LIGHTHOUSE_HOST_ENV, NODE_ENV, RANK0_ENV,
                             REPLICA_ENV, SECRET_ENV)

# the node agent: torchrun behind lowband's rendezvous check (lowband/launch/node.py, run by
# lowband/launch/__main__.py when its first argument is "torchrun")
AGENT = "python3 -m lowband.launch torchrun"


def train(
    *flags: str,
    script: Optional[str] = None,
    algo: Optional[str] = None,
    replicas: int = 2,
    shards: int = 1,
    replicas_per_node: int = 1,
    nnodes: int = 0,
    nproc_per_node: int = 0,
    run_dir: Optional[str] = None,
    config: Optional[str] = None,
    name: str = "lowband",
    image: str = "lowband:latest",
    h: Optional[str] = None,
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 4096,
    env: Optional[Dict[str, str]] = None,
    mounts: Optional[List[str]] = None,
    rdzv_port: int = 29500,
    rdzv_timeout: int = 300,
    max_retries: int = 0,
    progress: bool = False,
    debug: bool = False,
    elastic: bool = False,
    min_replicas: int = 1,
    max_restarts: int = 3,
    lighthouse_port: int = 29510,
    join_timeout: float = 60.0,
    heartbeat_timeout: float = 5.0,
    quorum_timeout: float = 600.0,
    elastic_timeout: float = 120.0,
    bind: Optional[str] = None,
    doctor: bool = False,
) -> specs.AppDef:
    """Train a language model with `lowband train`, or your own training script, across nodes
    (one torchrun agent per node).

    Args:
        flags: more `lowband train` flags, passed through as given (after `--` on the command
            line, e.g. `-- --model nano --steps 20 --sync-every 4`); with script, the script's
            own arguments
        script: a training script (a path on the nodes) to run on every rank instead of
            `lowband train`; it reads replicas, shards and the run directory from the
            environment (LOWBAND_REPLICAS, LOWBAND_SHARDS, LOWBAND_RUN_DIR); with elastic, a
            script that trains through lowband.Sync (or a Config from launch_config())
        algo: training algorithm (ddp, diloco, streaming); lowband's default when not given
            (not with script: pass it in the script's arguments)
        replicas: R, replica groups joined by the slow outer link
        shards: S, ranks inside each replica group joined by the fast inner link
        replicas_per_node: replica groups on each node when nnodes/nproc_per_node are not given
        nnodes: nodes (0: replicas / replicas_per_node, or derived from nproc_per_node)
        nproc_per_node: worker processes on each node (0: replicas_per_node x shards, or derived)
        run_dir: run directory, on a filesystem every node shares (default: runs/<app id>)
        config: a TOML file of `lowband train` options, as seen from the nodes (not with script)
        name: job name
        image: container image with lowband installed (Kubernetes, Docker; ignored by local_cwd
            and slurm)
        h: a registered named resource (takes precedence over cpu, gpu, memMB)
        cpu: CPUs per node
        gpu: GPUs per node
        memMB: memory per node in MB
        env: environment variables for the workers (e.g. NCCL_DEBUG=INFO,GLOO_SOCKET_IFNAME=eth0)
        mounts: mounts for the nodes' containers (e.g. type=bind,src=/shared,dst=/shared)
        rdzv_port: port of the rendezvous store on the first node
        rdzv_timeout: seconds a node waits to reach the rendezvous and for every node to join it
            before it fails with a clear message
        max_retries: scheduler retries of the whole job
        progress: show a progress bar on rank 0 (off for batch logs; LOWBAND_PROGRESS for a
            script)
        debug: turn on torch's distributed debug variables
        elastic: each replica group a role of its own (one node, `shards` processes) that the
            scheduler restarts up to max_restarts times, joined to the others through a
            torchft Lighthouse, the first role (docs/elastic.md); `lowband train --elastic`
        min_replicas: smallest quorum of replica groups an outer update commits with (elastic)
        max_restarts: scheduler restarts of each replica group's role (elastic)
        lighthouse_port: the Lighthouse's port on its node (elastic)
        join_timeout: seconds a quorum waits for a group that heartbeats but has not asked
            (elastic; lowband launch passes half the shorter of the run's quorum and elastic
            timeouts)
        heartbeat_timeout: seconds without a group's heartbeats before the Lighthouse leaves it
            out of quorums (elastic; `lowband train --heartbeat-timeout`)
        quorum_timeout: seconds a group waits for a quorum (elastic; a script's lowband.Sync
            takes it from LOWBAND_QUORUM_TIMEOUT)
        elastic_timeout: seconds an exchange or a heal may take (elastic; a script's
            lowband.Sync takes it from LOWBAND_ELASTIC_TIMEOUT)
        bind: the interface (eth0) or address on which every listener of the job's processes
            listens on its node (LOWBAND_BIND_HOST): stores, gloo, the Lighthouse and torchft's
            servers; default: the interface that routes to the first node (never every
            interface; lowband launch gives loopback to a local_cwd job)
        doctor: each node first runs `lowband doctor` with the others at the rendezvous's
            address and port (docs/doctor.md): a failed check ends the node, in one sentence,
            before any training process starts; the first node's log has the measured link
            and the plan on it (not with elastic)
    """
    if bind is not None:  # (each node resolves an interface's name to its own address)
        env = {**(env or {}), BIND_ENV: check_bind(bind, here=False)}
    if elastic and doctor:
        raise ValueError("doctor runs with the nodes of one job at its rendezvous, which an "
                         "elastic job's groups do not share: run `lowband doctor --nodes N "
                         "--rdzv HOST:PORT --elastic` on its nodes first instead.")
    if elastic:
        values = {"elastic": "1", "min_replicas": str(min_replicas),
                  "max_restarts": str(max_restarts), "quorum_timeout": f"{quorum_timeout:g}",
                  "elastic_timeout": f"{elastic_timeout:g}",
                  "heartbeat_timeout": f"{heartbeat_timeout:g}"}
        # the job's elastic options, for a script's lowband.Sync (launch/env.py), and the path
        # of its secret (comm/membership/secret.py: the Lighthouse role writes it unless lowband launch has)
        env = {SECRET_ENV: f"{run_dir or f'runs/{macros.app_id}'}/{SECRET_FILE}", **(env or {}),
               **{var: values[key] for key, (var, _) in ELASTIC_VARS.items()}}
        return _elastic(flags, script, algo, replicas, shards, run_dir or f"runs/{macros.app_id}",
                        config, name, image, h, cpu, gpu, memMB, env, mounts,
                        rdzv_timeout, progress, debug, min_replicas, max_restarts, lighthouse_port,
                        join_timeout, heartbeat_timeout)
    n, p = node_layout(replicas, shards, replicas_per_node, nnodes, nproc_per_node)
    return _nodes(flags, script, algo, replicas, shards, n, p, run_dir or f"runs/{macros.app_id}",
                  config, name, image, h, cpu, gpu, memMB, dict(env or {}), mounts, rdzv_port,
                  rdzv_timeout, max_retries, progress, debug, doctor)


def _nodes(flags, script, algo, replicas, shards, n, p, run_dir, config, name, image, h, cpu,
           gpu, memMB, env, mounts, rdzv_port, rdzv_timeout, max_retries, progress,
           debug, doctor=False) -> specs.AppDef:
    """One role of n nodes x p processes, each node running lowband's agent around torchrun."""
    if script:
        if algo or config:
            raise ValueError(f"--{'algo' if algo else 'config'} is a `lowband train` flag: with "
                             "a script, pass it among the script's own arguments.")
        args, program = [], {"script": script}
    else:
        # a resumed run keeps its own config, layout included (`lowband train --resume` takes
        # none of it again)
        sizes = [] if _resumes(flags) else ["--replicas", str(replicas), "--shards", str(shards)]
        args = ["train", *sizes, "--run-dir", run_dir]
        if algo:
            args += ["--algo", algo]
        if config:
            args += ["--config", config]
        if not progress:
            args += ["--no-progress"]
        program = {"m": "lowband.cli"}
    layout = (str(replicas), str(shards), run_dir, "1" if progress else "0")
    # the node's name: its log is RUN/logs/<name>.log (the agent copies its output there)
    env = dict(env or {})
    env = {**env, **dict(zip(LAYOUT_ENV, layout)),
           NODE_ENV: env.get(NODE_ENV, f"node{macros.replica_id}")}
    app = dist.ddp(
        *args, *flags, **program, name=name, image=image, h=h, cpu=cpu, gpu=gpu,
        memMB=memMB, j=f"{n}x{p}", env=env, max_retries=max_retries,
        rdzv_port=rdzv_port, mounts=mounts, debug=debug)
    role = app.roles[0]
    role.name = "node"
    timeouts = f"join_timeout={rdzv_timeout},read_timeout={min(rdzv_timeout, 60)}"
    assert role.args[1].startswith("torchrun "), role.args
    role.args[1] = f"{AGENT} --rdzv_conf {timeouts} " + role.args[1][len("torchrun "):]
    if doctor:
        first = _doctor(role.args[1], n, bool(script) or _resumes(flags), rdzv_port, rdzv_timeout)
        role.args[1] = f"{first} && {role.args[1]}"
    return app


def _doctor(command: str, n: int, no_plan: bool, port: int, timeout: int) -> str:
    """The node's doctor (lowband/doctor/): with the other nodes at the rendezvous's address and
    port, before its agent binds that port; the plan for `lowband train`'s own flags (those
    after `-m lowband.cli train` in the agent's command, quoted as they are there)."""
    plan = "--no-plan" if no_plan else "-- " + command.split(" -m lowband.cli train ", 1)[1]
    if n == 1:  # one node: this machine and its transport
        return "python3 -m lowband.doctor --no-plan"
    return (f"python3 -m lowband.doctor --nodes {n} --rdzv $${{{macros.rank0_env}:=localhost}}:"
            f"{port} --timeout {timeout} {plan}")


def _elastic(flags, script, algo, replicas, shards, run_dir, config, name, image, h, cpu, gpu,
             memMB, env, mounts, rdzv_timeout, progress, debug, min_replicas, max_restarts,
             port, join_timeout, heartbeat_timeout) -> specs.AppDef:
    """--elastic: role 0 runs the Lighthouse (python -m lowband.launch lighthouse, which also
    writes summary.json from the groups' records when they are done); role 1 + g is replica
    group g, `shards` processes on one node whose agent restarts them when one dies: `lowband
    train --elastic`, or the script (its lowband.Sync reads LOWBAND_REPLICA, TORCHFT_LIGHTHOUSE
    and the elastic options from its environment, and counts its lives in torchrun's
    TORCHELASTIC_RESTART_COUNT). Every role finds the Lighthouse through the scheduler's rank-0
    host variable, which names role 0's first node. (On Slurm, `lowband launch` submits each
    group as a requeued job of its own, so a node lost for good takes only its group, which
    comes back: launch/slurm.py.)"""
    if not script and "--elastic" not in flags and not _resumes(flags):
        flags = (*flags, "--elastic")
    # (on Slurm each group is a job of its own, told the Lighthouse's node: launch/slurm.py)
    address = f"http://$${{{LIGHTHOUSE_HOST_ENV}:-$${{{macros.rank0_env}:=localhost}}}}:{port}"
    lighthouse = specs.Role(
        name="lighthouse", image=image, entrypoint="python3",
        args=["-m", "lowband.launch", "lighthouse", "--port", str(port), "--min-replicas",
              str(min_replicas), "--run-dir", run_dir, "--replicas", str(replicas),
              "--join-timeout", f"{join_timeout:g}", "--heartbeat-timeout",
              f"{heartbeat_timeout:g}"],
        num_replicas=1, resource=specs.resource(cpu=1, gpu=0, memMB=1024),
        # its bind address by default: the route to its own node, named by the rank-0 host
        # variable (the name of that variable: its environment is not expanded by a shell)
        env={**env, RANK0_ENV: macros.rank0_env}, max_retries=0,
        mounts=specs.parse_mounts(mounts) if mounts else [])
    roles = [lighthouse]
    for g in range(replicas):
        group = _nodes(flags, script, algo, replicas, shards, 1, shards, run_dir, config, name,
                       image, h, cpu, gpu, memMB,
                       {**env, REPLICA_ENV: str(g), NODE_ENV: f"group{g}"}, mounts,
                       29500, rdzv_timeout, 0, progress, debug)
        role = group.roles[0]
        role.name = f"group{g}"
        # the group's own agent restarts its workers (torchrun --max-restarts; they count their
        # lives in TORCHELASTIC_RESTART_COUNT): a scheduler retry would restart the whole job
        role.args[1] = role.args[1].replace(" torchrun ", f" torchrun --max_restarts {max_restarts} ", 1)
        # in the command line, where the role's shell expands the rank-0 host variable on every
        # scheduler (an environment value is expanded only by Slurm's batch script)
        role.args[1] = f"{LIGHTHOUSE_ENV}={address} {role.args[1]}"
        roles.append(role)
    return specs.AppDef(name=name, roles=roles)


def _resumes(flags) -> bool:
    return any(f == "--resume" or f.startswith("--resume=") for f in flags)


def node_layout(replicas: int, shards: int, replicas_per_node: int, nnodes: int,
                nproc_per_node: int) -> Tuple[int, int]:
    """(nnodes, nproc_per_node) for R replicas x S shards; ValueError (one sentence) if none."""
    world = replicas * shards
    if replicas <= 0 or shards <= 0:
        raise ValueError(f"replicas and shards must be positive, got {replicas} and {shards}.")
    if nnodes < 0 or nproc_per_node < 0 or replicas_per_node <= 0:
        raise ValueError("nnodes and nproc_per_node must be 0 (derive) or positive, and "
                         "replicas_per_node positive.")
    if not nnodes and not nproc_per_node:
        if replicas % replicas_per_node:
            raise ValueError(f"replicas_per_node {replicas_per_node} does not divide replicas "
                             f"{replicas}: pick a divisor, or give nnodes and nproc_per_node.")
        nnodes, nproc_per_node = replicas // replicas_per_node, replicas_per_node * shards
    elif not nproc_per_node:
        nproc_per_node = max(world // nnodes, 1)
    elif not nnodes:
        nnodes = max(world // nproc_per_node, 1)
    if nnodes * nproc_per_node != world:
        raise ValueError(
            f"replicas {replicas} x shards {shards} = {world} ranks, but nnodes {nnodes} x "
            f"nproc_per_node {nproc_per_node} = {nnodes * nproc_per_node} processes: make them "
            "equal (by default nnodes = replicas and nproc_per_node = shards).")
    return nnodes, nproc_per_node
