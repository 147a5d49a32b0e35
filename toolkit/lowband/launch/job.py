"""Building and submitting a lowband TorchX job: launch(), and components() (the component
module it builds the job from, component.py).

launch() checks the `lowband train` flags here with `lowband train`'s own parser (one sentence
on bad input, before anything is submitted), fills in the component's parameters, asks TorchX
for the request (dryrun) and returns a LaunchHandle, started unless start=False. With script=,
every rank runs the user's training script instead, with the same layout, agent and run
directory; its arguments are its own (lowband checks only the layout it owns).
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from pathlib import Path
from typing import Sequence

from lowband.comm.membership.bind import LOOPBACK, check_bind
from lowband.comm.membership.elastic import TORCHFT, join_timeout_s
from lowband.comm.membership.secret import FILE
from lowband.config import ConfigError
from lowband.flags import parse_train
from lowband.launch.env import ELASTIC_VARS
from lowband.launch.handle import (LOCAL_SCHEDULERS, TORCHX, LaunchHandle, _get_runner,
                                   _keep_signals)
from lowband.options import REQUEUE_ENV, SECRET_ENV, needs_extra

# -- the component ---------------------------------------------------------------------------------

def components():
    """The module of lowband's TorchX component (component.py; imported here on first use, as
    it imports TorchX).

    Also the target of the `torchx.components` entry point, so `torchx run lowband.train` finds it.
    """
    import lowband.launch.component

    return lowband.launch.component


# -- launching -------------------------------------------------------------------------------------

_FLAG_VALUES = (str, int, float, os.PathLike)  # bool is an int


def _refuse_objects(options: dict, flags: Sequence) -> None:
    """One sentence for a value that cannot become a command-line flag: the job's processes get
    only a command line, so a module object (or any object) cannot travel to them."""
    model = options.get("model")
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise ConfigError(f"model= got a {type(model).__name__} object, and a module object "
                          "cannot travel to the job's processes: pass model=\"hf:PATH\" (a saved "
                          "Hugging Face directory) or script= a training script that builds it.")
    for key, value in options.items():
        if value is not None and not isinstance(value, _FLAG_VALUES):
            raise ConfigError(f"{key}= got a {type(value).__name__} object, which cannot be a "
                              "command-line flag of the job: give a string, a number or "
                              "True/False.")
    for tok in flags:
        if not isinstance(tok, _FLAG_VALUES) or isinstance(tok, bool):
            raise ConfigError(f"flags hold a {type(tok).__name__} object ({tok!r:.40}), which "
                              "cannot be a command-line argument of the job: give strings.")


def _arg(value) -> str:
    return os.fspath(value) if isinstance(value, os.PathLike) else str(value)


def flag_args(options: dict) -> list[str]:
    """Keywords as flags: steps=20 -> --steps 20, progress=False -> --no-progress (None: none)."""
    out = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, _arg(value)]
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


def launch(flags: Sequence[str] = (), *, scheduler: str = "local_cwd", cfg: dict | None = None,
           script: str | os.PathLike | None = None, script_args: Sequence[str] = (),
           algo: str | None = None, replicas: int | None = None, shards: int | None = None,
           run_dir: str | os.PathLike | None = None, config: str | None = None,
           replicas_per_node: int = 1, nnodes: int = 0, nproc_per_node: int = 0,
           name: str = "lowband", image: str | None = None, h: str | None = None, cpu: int = 2,
           gpu: int = 0, memMB: int = 4096, env: dict | None = None,
           mounts: Sequence[str] | None = None, rdzv_port: int = 0, rdzv_timeout: int = 300,
           max_retries: int = 0, progress: bool = False, bind: str | None = None,
           requeue: int | None = None, doctor: bool = False, start: bool = True,
           **options) -> LaunchHandle:
    """Run `lowband train` (or your own training script) as a TorchX job; return its LaunchHandle
    at once.

    flags: `lowband train` flags as a list (["--model", "nano"]); options: the same as keywords
    (model="nano", steps=20, sync_every=4; True/False for on/off flags; model="hf:PATH" for a
    saved Hugging Face model: a module object cannot travel to the job's processes).
    script: a training script every rank runs instead of `lowband train` (a path here for local
    schedulers, on the nodes for remote ones); its arguments are script_args, then flags and the
    keyword options (algo= and config= included) as `--key value`, passed as given. The workers'
    environment gives it the layout lowband owns: LOWBAND_REPLICAS, LOWBAND_SHARDS,
    LOWBAND_RUN_DIR and LOWBAND_PROGRESS (lowband.launch.layout() / launch_config() read them).
    elastic=True (with min_replicas=, max_restarts=, quorum_timeout=, elastic_timeout=,
    heartbeat_timeout=, which are then the job's, not the script's) runs each replica group as
    a job of its own joined by a Lighthouse, restarted when it dies: a script whose lowband.Sync
    takes them from its environment (docs/elastic.md).
    scheduler: local_cwd, slurm, kubernetes or any TorchX scheduler; cfg: its run options (merged
    over .torchxconfig). The rest are the component's parameters (see
    lowband/launch/component.py): by default one replica group per node. rdzv_port 0 picks a
    free port for local schedulers, 29500 elsewhere. bind: the interface (eth0) or address
    the job's listeners bind on each node (default: the interface that routes to the first
    node; loopback for local_cwd; never every interface: comm/membership/bind.py).
    requeue=SECONDS (Slurm): that long before the job's time limit every rank stops at one step,
    writes a checkpoint and requeues the job, which continues from it (checkpoint/preempt.py).
    doctor=True: each node first runs `lowband doctor` with the others (docs/doctor.md); a
    failed check ends the job in one sentence before any training process starts.
    start=False returns the handle unsubmitted: inspect .dryrun_info, then start(). Bad input
    raises ConfigError with one sentence, before anything is submitted.
    """
    needs_extra(*TORCHX)
    if scheduler == "kubernetes":
        needs_extra("kubernetes", "TorchX's kubernetes scheduler", "kubernetes")
    from torchx.runner.config import apply
    from torchx.specs.api import InvalidRunConfigException

    known = _get_runner().scheduler_backends()
    if scheduler not in known:
        raise ConfigError(f"unknown scheduler '{scheduler}': use one of {', '.join(known)}.")
    local = scheduler in LOCAL_SCHEDULERS
    _refuse_objects({**options, "algo": algo, "config": config}, [*flags, *script_args])
    if script is not None:
        # elastic=, min_replicas=, ... are the job's (its Lighthouse and restarts), not the script's
        elastic = {k: v for k in ELASTIC_VARS if (v := options.pop(k, None)) is not None}
        flags, algo, config, run_dir, layout = _script_job(
            script, [*script_args, *flags, *flag_args({"algo": algo, "config": config}),
                     *flag_args(options)], replicas, shards, run_dir, local, elastic)
        script = layout.pop("script")
    else:
        if script_args:
            raise ConfigError("script_args= are the arguments of a training script: give "
                              "script= too, or pass `lowband train` flags as flags= or keywords.")
        flags, algo, config, run_dir, layout = _train_job(
            flags, options, algo, replicas, shards, run_dir, config, local)
    run_dir = str(run_dir)
    local_run_dir = Path(run_dir).resolve() if not os.path.isabs(run_dir) else Path(run_dir)
    if local:
        run_dir = str(local_run_dir)
    if bind is not None:
        check_bind(bind, here=scheduler == "local_cwd")
    elif scheduler == "local_cwd":  # one machine, no containers: every listener on loopback
        bind = LOOPBACK
    env = dict(env or {})
    if requeue is not None:
        _check_requeue(requeue, scheduler, script, layout)
        env[REQUEUE_ENV] = "1"
    # the file, not the bytes: the job's spec (its dry run, a batch script) never holds them
    env[SECRET_ENV] = os.path.join(run_dir, FILE)
    if local:  # the nodes run this interpreter's python3 and torchrun, as the agent expects
        env["PATH"] = os.pathsep.join(p for p in (os.path.dirname(sys.executable),
                                                  env.get("PATH")) if p)
        if not rdzv_port:
            from lowband.launch.local import free_port

            rdzv_port = free_port()
        # the local nodes share this machine's cores: no OpenMP threads spinning on them
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        app = components().train(
            *flags, script=script, algo=algo, replicas=layout["replicas"],
            shards=layout["shards"], replicas_per_node=replicas_per_node, nnodes=nnodes,
            nproc_per_node=nproc_per_node, run_dir=run_dir, config=config, name=name,
            h=h, cpu=cpu, gpu=gpu, memMB=memMB, env=env, mounts=list(mounts) if mounts else None,
            rdzv_port=rdzv_port or 29500, rdzv_timeout=rdzv_timeout, max_retries=max_retries,
            progress=progress, bind=bind, doctor=doctor, **({"image": image} if image else {}),
            **{k: v for k, v in layout.items() if k not in ("replicas", "shards")})
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
    if scheduler == "slurm" and layout.get("elastic"):  # a Slurm job a group (launch/slurm.py)
        from lowband.launch.slurm import elastic_request

        info.request = elastic_request(info.request)
    if requeue is not None:  # SIGUSR1 to every node's agent before the time limit (slurm.py)
        from lowband.launch.slurm import signal_before_limit

        signal_before_limit(info.request, requeue)
    handle = LaunchHandle(runner, info, local_run_dir, scheduler, app.roles[0].num_replicas)
    return handle.start() if start else handle


def _check_requeue(seconds, scheduler: str, script, layout: dict) -> None:
    """--requeue: Slurm's, for `lowband train` without --elastic, a whole number of seconds."""
    if scheduler != "slurm":
        raise ConfigError("--requeue asks Slurm for a signal before the job's time limit: give "
                          "-s slurm, or leave it out.")
    if script is not None or layout.get("elastic"):
        raise ConfigError("--requeue stops `lowband train`'s own workers at one step; a script "
                          "and --elastic groups stop their own way: leave it out.")
    if isinstance(seconds, bool) or not isinstance(seconds, int) or seconds <= 0:
        raise ConfigError(f"--requeue takes the seconds before the time limit, got {seconds!r}: "
                          "give a positive whole number (e.g. 300).")


def _default_run_dir(label: str) -> str:
    return os.path.join("runs", f"{label}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}")


def _train_job(flags, options, algo, replicas, shards, run_dir, config, local):
    """`lowband train`: its flags checked here; (flags, algo, config, run_dir, layout)."""
    # the component passes these itself: take them out of the pass-through flags
    flags, given = _pop_flags([*map(_arg, flags), *flag_args(options)],
                              ("algo", "replicas", "shards", "run-dir", "config"))
    algo = algo if algo is not None else given.get("algo")
    config = os.fspath(config) if config is not None else given.get("config")
    run_dir = run_dir if run_dir is not None else given.get("run-dir")
    argv = list(flags)
    for key, value in (("algo", algo), ("replicas", replicas if replicas is not None else
                                        given.get("replicas")),
                       ("shards", shards if shards is not None else given.get("shards")),
                       ("config", config)):
        if value is not None:
            argv += [f"--{key}", str(value)]
    # checked here as `lowband train` checks it, before anything is submitted
    train_cfg, resume = parse_train(argv, here=local)
    if run_dir is None or resume:  # a resumed run goes on in its own directory
        run_dir = train_cfg.run_dir or _default_run_dir(train_cfg.algo)
    layout = {"replicas": train_cfg.replicas, "shards": train_cfg.shards}
    if train_cfg.elastic:
        layout.update(_elastic_layout(train_cfg, local))
    return flags, algo, config, run_dir, layout


def _elastic_layout(cfg, local: bool) -> dict:
    """The component's parameters of an elastic job (a Lighthouse role and a restarted role a
    group: docs/elastic.md) from its validated Config; a local job's Lighthouse on a free port."""
    if local:  # (remote nodes have their own installs)
        needs_extra(*TORCHFT)
    out = {"elastic": True, "join_timeout": join_timeout_s(cfg),
           **{k: getattr(cfg, k) for k in ELASTIC_VARS if k != "elastic"}}
    if local:
        from lowband.launch.local import free_port

        out["lighthouse_port"] = free_port()
    return out


def _script_job(script, argv, replicas, shards, run_dir, local, elastic: dict):
    """A user's training script: its arguments passed as given; only the layout lowband owns
    (replicas, shards, run directory; elastic: the job's elastic options) is checked here. A
    local script must exist here; a remote one lives on the nodes."""
    from lowband.comm.membership.elastic import ElasticOptions
    from lowband.config import Config

    script = os.fspath(script)
    if local:
        path = Path(script).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"training script '{script}' is not a file: give the path of your "
                              "script (relative to this directory or absolute).")
        script = str(path)
    layout = {"script": script}
    for key, value, default in (("replicas", replicas, Config().replicas),
                                ("shards", shards, Config().shards)):
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, (int, str)) or \
                not str(value).strip().isdigit() or int(value) <= 0:
            raise ConfigError(f"{key} must be a positive integer, got {value!r}.")
        layout[key] = int(value)
    others = [k for k in elastic if k != "elastic"]
    if others and not elastic.get("elastic"):
        raise ConfigError(f"{others[0]}= is an option of an elastic job: give elastic=True "
                          "(lowband launch --elastic) too, or leave it out.")
    if elastic.get("elastic"):
        cfg = Config(replicas=layout["replicas"], shards=layout["shards"], **elastic)
        ElasticOptions.check(cfg)
        layout.update(_elastic_layout(cfg, local))
    if run_dir is None:
        run_dir = _default_run_dir(Path(script).stem)
    return [_arg(a) for a in argv], None, None, os.fspath(run_dir), layout
