"""Launching through TorchX: the component, lowband.launch on local_cwd for real, and the requests
TorchX would send to Slurm and Kubernetes (dry runs: no cluster here)."""

import gc
import importlib.util
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torchx")

import yaml  # noqa: E402  (a torchx dependency)
from torchx.specs import file_linter  # noqa: E402

import lowband  # noqa: E402
from lowband.config import Config, ConfigError  # noqa: E402
from lowband.launch import attach, components  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMPONENT = ROOT / "launchers" / "lowband_components.py"
TINY = dict(algo="ddp", link_bandwidth="none", model="nano", seq_len=32, batch_size=4,
            eval_every=0, eval_batches=1)


def torchx_cli(*args):
    """The `torchx` command, run from the repository root (where .torchxconfig is)."""
    return subprocess.run([sys.executable, "-m", "torchx.cli.main", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def job_pids(app_handle: str) -> list[int]:
    """Live processes of a local job: the agents and the workers they started."""
    mark = f"TORCHX_JOB_ID={app_handle}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if mark in (d / "environ").read_bytes().split(b"\0"):
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


# -- the component ----------------------------------------------------------------------------

def test_component_passes_torchx_linter():
    # the packaged component (what an installed wheel has) and its re-export by path
    assert file_linter.validate(components().__file__, "train") == []
    assert file_linter.validate(str(COMPONENT), "train") == []
    assert components().__name__ == "lowband.launch.component"


def test_component_defaults_are_the_cli_defaults():
    defaults = components().train.__kwdefaults__
    assert (defaults["replicas"], defaults["shards"]) == (Config().replicas, Config().shards)


def test_replicas_map_to_nodes():
    layout = components().node_layout
    assert layout(4, 2, 1, 0, 0) == (4, 2)      # default: one replica group per node
    assert layout(4, 2, 2, 0, 0) == (2, 4)      # replicas_per_node packs groups
    assert layout(4, 2, 1, 8, 0) == (8, 1)      # nnodes alone: nproc derived
    assert layout(2, 4, 1, 0, 8) == (1, 8)      # nproc_per_node alone: nnodes derived
    with pytest.raises(ValueError, match=r"^replicas 2 x shards 2 = 4 ranks, but nnodes 3 x "
                                         r"nproc_per_node 2 = 6 processes: make them equal"):
        layout(2, 2, 1, 3, 2)
    with pytest.raises(ValueError, match="replicas_per_node 3 does not divide replicas 4"):
        layout(4, 1, 3, 0, 0)


def test_registered_name_keeps_torchx_builtins():
    from torchx.specs.finder import get_components

    names = set(get_components())
    assert {"lowband.train", "dist.ddp", "dist.spmd", "utils.echo"} <= names


@pytest.mark.slow
def test_torchx_cli_dry_runs_by_name_and_by_path():
    by_name = torchx_cli("run", "--dryrun", "-s", "slurm", "lowband.train", "--replicas", "2",
                         "--shards", "2", "--", "--model", "nano")
    assert by_name.returncode == 0, by_name.stderr
    assert "--nnodes 2 --nproc_per_node 2" in by_name.stdout
    assert "-m lowband.cli train --replicas 2 --shards 2" in by_name.stdout
    assert "--model nano" in by_name.stdout
    # .torchxconfig: local_cwd by default, lowband.train the default component
    by_path = torchx_cli("run", "--dryrun", f"{COMPONENT.relative_to(ROOT)}:train", "--replicas",
                         "1", "--shards", "2")
    assert by_path.returncode == 0, by_path.stderr
    assert "local_cwd" in by_path.stderr + by_path.stdout
    assert "--rdzv_endpoint localhost:0" in by_path.stdout  # one node: any free port
    echo = torchx_cli("run", "--dryrun", "utils.echo", "--msg", "hi")
    assert echo.returncode == 0, echo.stderr
    if importlib.util.find_spec("kubernetes"):  # the queue comes from .torchxconfig
        k8s = torchx_cli("run", "--workspace", "", "--dryrun", "-s", "kubernetes", "lowband.train",
                         "--image", "registry.example/lowband:1")
        assert k8s.returncode == 0, k8s.stderr
        assert "queue: default" in k8s.stdout and "image: registry.example/lowband:1" in k8s.stdout


def test_mismatched_layout_is_one_sentence(capsys):
    from lowband.cli import main

    assert main(["launch", "--dryrun", "--nnodes", "3", "--replicas", "2", "--model", "nano"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "make them equal" in err, err
    with pytest.raises(ConfigError, match="unknown algorithm"):
        lowband.launch(algo="nope", start=False)


# -- the pre-submit check is `lowband train`'s own parse (lowband.flags.parse_train) ---------------

def verdicts(argv: list[str]) -> list:
    """What `lowband train ARGV` makes of it, then `lowband launch` on local_cwd and on Slurm (a
    dry run): each a (replicas, shards, resumes) layout, or the one sentence it was refused with."""
    from lowband.flags import parse_train

    out = []
    try:
        cfg, resume = parse_train(argv)
        out.append((cfg.replicas, cfg.shards, resume))
    except ConfigError as e:
        out.append(str(e))
    for scheduler in ("local_cwd", "slurm"):
        try:
            h = lowband.launch(argv, scheduler=scheduler, start=False)
        except ConfigError as e:
            out.append(str(e))
            continue
        request = str(h.dryrun_info)
        (layout,) = {(int(r), int(s)) for r, s in re.findall(r"--nnodes (\d+) --nproc_per_node (\d+)",
                                                             request)}
        out.append((*layout, "--resume" in request))
    return out


def test_launch_checks_recipes_and_resumes_as_train_does(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    saved = Config(model="nano", replicas=3, steps=8, algo="diloco").validate().to_dict()
    (run / "config.json").write_text(json.dumps({**saved, "run_dir": str(run)}))
    (tmp_path / "a.toml").write_text('model = "nano"\n')
    accepted = {
        ("--recipe", "main", "--steps", "10"): (2, 1, False),
        ("--recipe", "main", "--replicas", "4"): (4, 1, False),
        ("--resume", str(run)): (3, 1, True),
        ("--resume", str(run), "--steps", "20"): (3, 1, True),
    }
    for argv, layout in accepted.items():
        assert verdicts(list(argv)) == [layout] * 3, argv
    refused = {
        ("--recipe", "nope"): "unknown recipe 'nope'",
        ("--recipe", "main", "--config", str(tmp_path / "a.toml")): "pick one",
        ("--resume", str(run), "--lr", "0.1"): "--lr cannot be given with it",
        ("--resume", str(run), "--replicas", "2"): "--replicas cannot be given with it",
        ("--resume", str(tmp_path / "none")): "is not a lowband run directory",
        ("--bogus", "1"): "unrecognized arguments: --bogus 1",
    }
    for argv, words in refused.items():
        said = verdicts(list(argv))
        assert said == [said[0]] * 3 and words in said[0], (argv, said)
    # a resumed run goes on in its own directory, under its own config: no layout flags again
    h = lowband.launch(["--resume", str(run)], scheduler="slurm", start=False)
    script = h.dryrun_info.request.materialize()
    assert h.run_dir == run and f"train --run-dir {run} --no-progress --resume {run}" in script


def test_bad_launch_flag_is_trains_sentence(capsys):
    from lowband.cli import main

    assert main(["train", "--recipe", "main", "--bogus"]) == 2
    train_said = capsys.readouterr().err
    assert main(["launch", "--dryrun", "-s", "slurm", "--", "--recipe", "main", "--bogus"]) == 2
    launch_said = capsys.readouterr()
    assert launch_said.err == train_said and train_said.count("\n") == 1, train_said
    assert "--bogus" in train_said and launch_said.out == ""  # nothing printed, nothing submitted


# -- Slurm and Kubernetes: the generated requests --------------------------------------------------

CLUSTER = dict(algo="streaming", replicas=2, shards=4, gpu=4, cpu=16, memMB=64000,
               env={"NCCL_DEBUG": "INFO"}, mounts=["type=bind", "src=/shared", "dst=/shared"],
               run_dir="/shared/runs/a", model="mini", start=False)


def test_slurm_request():
    h = lowband.launch(scheduler="slurm", **CLUSTER)
    assert h.status() == "not started" and h.app_handle is None
    script = h.dryrun_info.request.materialize()
    assert script.count("#SBATCH --job-name=node-") == 2  # one het group per node
    assert "--cpus-per-task=16 --mem=64000 --gpus-per-task=4" in script
    # every node finds the rendezvous on the first node's host name, which Slurm provides
    assert script.count("--rdzv_endpoint ${SLURM_JOB_NODELIST_HET_GROUP_0:=localhost}:29500") == 2
    assert script.count("--nnodes 2 --nproc_per_node 4") == 2
    assert "python3 -m lowband.launch torchrun --rdzv_conf join_timeout=300" in script
    assert "--export=ALL,NCCL_DEBUG=INFO," in script
    assert ("-m lowband.cli train --replicas 2 --shards 4 --run-dir /shared/runs/a --algo "
            "streaming --no-progress --model mini") in script
    assert h.run_dir == Path("/shared/runs/a")


def test_kubernetes_request():
    pytest.importorskip("kubernetes")
    h = lowband.launch(scheduler="kubernetes", image="registry.example/lowband:1",
                       cfg={"queue": "default"}, **CLUSTER)
    job = yaml.safe_load(str(h.dryrun_info))
    assert job["kind"] == "Job" and job["spec"]["schedulerName"] == "volcano"
    tasks = job["spec"]["tasks"]
    assert [t["name"] for t in tasks] == ["node-0", "node-1"]
    for k, task in enumerate(tasks):
        pod = task["template"]["spec"]
        (c,) = pod["containers"]
        assert c["image"] == "registry.example/lowband:1"
        command = " ".join(c["command"])
        # TorchX expands the component's $${rank0_env}: the first node hosts the store itself,
        # the others reach it through Volcano's host list of node-0
        rank0 = "TORCHX_RANK0_HOST" if k == 0 else "VC_NODE_0_HOSTS"
        assert f"--rdzv_endpoint ${{{rank0}:=localhost}}:29500" in command
        assert "--nnodes 2 --nproc_per_node 4" in command
        assert "-m lowband.cli train --replicas 2 --shards 4 --run-dir /shared/runs/a" in command
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["NCCL_DEBUG"] == "INFO"
        limits = c["resources"]["limits"]
        assert (limits["cpu"], limits["memory"], limits["nvidia.com/gpu"]) == ("16000m",
                                                                               "64000M", "4")
        assert {"mountPath": "/shared", "name": "mount-0", "readOnly": False} in c["volumeMounts"]
        assert {"hostPath": {"path": "/shared"}, "name": "mount-0"} in pod["volumes"]
        assert c["ports"] == [{"containerPort": 29500, "name": "c10d"}]


# -- local_cwd, for real --------------------------------------------------------------------------

@pytest.mark.slow
def test_local_run_outlives_the_call_and_its_handle(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sigint = signal.getsignal(signal.SIGINT)
    t0 = time.monotonic()
    h = lowband.launch(steps=6, progress=True, **TINY)
    assert time.monotonic() - t0 < 15  # returns at once, the job runs on
    assert signal.getsignal(signal.SIGINT) is sigint  # a kernel's interrupt stays its own
    assert h.status() in ("pending", "running")
    assert h.app_handle.startswith("local_cwd://")
    assert h.run_dir.parent == tmp_path / "runs" and h.run_dir.name.startswith("ddp-")
    app_handle, run_dir = h.app_handle, h.run_dir
    del h  # the notebook dropped the handle; the cell is long finished
    gc.collect()
    h = attach(app_handle)
    assert h.run_dir == run_dir and h.nnodes == 2
    assert h.wait(timeout=120) == "succeeded"
    summary = h.summary()
    assert summary["steps"] == 6 and summary["replicas"] == 2
    assert sorted(p.name for p in (run_dir / "events").iterdir()) == ["rank0.jsonl", "rank1.jsonl"]
    logs = h.logs()
    # the node's output, its summary line last (a log is no terminal: no progress bar there)
    assert "== node 0 ==" in logs and "ddp R=2 S=1: loss" in logs, logs
    assert "6/6" not in logs, logs
    assert all(f.is_relative_to(run_dir / "logs" / "torchx") for f in h.log_files())
    h.cancel()  # nothing to stop any more
    assert h.status() == "succeeded"


@pytest.mark.slow
def test_cancel_stops_every_process(tmp_path):
    h = lowband.launch(steps=100_000, run_dir=tmp_path / "run", **TINY)
    for attr in ("run_dir", "start", "status", "cancel"):  # what the dashboard looks for
        assert hasattr(h, attr)
    events = h.run_dir / "events" / "rank0.jsonl"
    deadline = time.monotonic() + 90
    while not (events.is_file() and b'"kind":"step"' in events.read_bytes()):
        assert h.status() == "running" and time.monotonic() < deadline, h.logs()
        time.sleep(0.2)
    assert len(job_pids(h.app_handle)) >= 4  # 2 agents and 2 workers
    t0 = time.monotonic()
    h.cancel()
    assert h.status() == "cancelled"
    assert h.wait(timeout=1) == "cancelled"
    while job_pids(h.app_handle) and time.monotonic() - t0 < 15:
        time.sleep(0.2)
    assert job_pids(h.app_handle) == []


def test_the_components_defaults_are_lowband_trains():
    """TorchX reads the component's defaults from its signature, so they are literals there; each
    is tied here to the `lowband train` option it stands for (fails when one drifts)."""
    import dataclasses
    import inspect

    from lowband.comm.membership.elastic import ElasticOptions, join_timeout_s
    from lowband.config import fields

    train = {f.name: f.default for f in fields()}
    signature = inspect.signature(components().train).parameters
    tied = ["replicas", "shards", *(f.name for f in dataclasses.fields(ElasticOptions))]
    for name in tied:
        assert signature[name].default == train[name], name
        assert type(signature[name].default) is type(train[name]), name
    assert signature["join_timeout"].default == join_timeout_s(ElasticOptions())
