"""A user's own training script through lowband.launch(script=...): run for real on local_cwd
(a tiny Hugging Face Llama built in the script, trained with lowband.train.train), the requests
TorchX would send to Slurm and Kubernetes (dry runs), the layout the script reads from its
environment, and what launch() refuses: a module object, values that cannot be flags."""

import json
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torchx")

import torch.nn as nn  # noqa: E402
import yaml  # noqa: E402  (a torchx dependency)

import lowband  # noqa: E402
from lowband.config import ConfigError  # noqa: E402
from lowband.launch import components, env, launch_config, layout  # noqa: E402

SCRIPT = textwrap.dedent('''
    """A user's training script: its own model, lowband's layout from the environment."""
    import argparse
    from transformers import AutoConfig, AutoModelForCausalLM
    from lowband.launch import launch_config
    from lowband.train import train

    p = argparse.ArgumentParser()
    p.add_argument("hf_dir")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--algo", default="ddp")
    args = p.parse_args()
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.hf_dir))
    cfg = launch_config(algo=args.algo, steps=args.steps, sync_every=2, seq_len=32, batch_size=4,
                        eval_every=0, eval_batches=1, link_bandwidth="")
    summary = train(cfg, model=model)
    if summary is not None:
        print("MINE DONE", cfg.replicas, cfg.shards, summary["steps"])
''')

CLUSTER = dict(replicas=2, shards=4, gpu=4, cpu=16, memMB=64000, env={"NCCL_DEBUG": "INFO"},
               mounts=["type=bind", "src=/shared", "dst=/shared"], run_dir="/shared/runs/mine",
               script="jobs/train_mine.py", script_args=["/shared/models/llama", "--lr", "3e-4"],
               steps=100, start=False)


# -- local_cwd, for real --------------------------------------------------------------------------

@pytest.mark.slow
def test_local_script_trains_a_hugging_face_model(llama, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train_mine.py").write_text(SCRIPT)
    h = lowband.launch(script="train_mine.py", script_args=[llama], replicas=2, shards=1,
                       steps=4, algo="diloco")  # keywords: the script's flags
    (node,) = h.dryrun_info.request.role_params["node"][:1]  # a local script: by its full path
    assert node.args[-1].endswith(f"--role '' {tmp_path / 'train_mine.py'} {llama} --algo diloco "
                                  "--steps 4"), node.args
    assert h.run_dir.parent == tmp_path / "runs" and h.run_dir.name.startswith("train_mine-")
    assert h.wait(timeout=150) == "succeeded", h.logs()
    summary = h.summary()
    assert summary["replicas"] == 2 and summary["steps"] == 4, summary
    config = json.loads((h.run_dir / "config.json").read_text())
    assert (config["algo"], config["replicas"], config["shards"]) == ("diloco", 2, 1)
    assert config["run_dir"] == str(h.run_dir) and config["progress"] is False
    assert sorted(p.name for p in (h.run_dir / "events").iterdir()) == ["rank0.jsonl",
                                                                        "rank1.jsonl"]
    assert "MINE DONE 2 1 4" in h.logs()


# -- Slurm and Kubernetes: the generated requests --------------------------------------------------

def test_slurm_request_runs_the_script_through_the_agent():
    h = lowband.launch(scheduler="slurm", **CLUSTER)
    script = h.dryrun_info.request.materialize()
    assert script.count("#SBATCH --job-name=node-") == 2
    assert script.count("python3 -m lowband.launch torchrun --rdzv_conf join_timeout=300") == 2
    assert script.count("--rdzv_endpoint ${SLURM_JOB_NODELIST_HET_GROUP_0:=localhost}:29500") == 2
    assert script.count("--nnodes 2 --nproc_per_node 4") == 2
    # the script as given (a path on the cluster), its arguments as given, keywords as its flags
    assert "jobs/train_mine.py /shared/models/llama --lr 3e-4 --steps 100'" in script
    assert "lowband.cli" not in script and "--no-progress" not in script
    # the run's secret travels as its file's path (comm/membership/secret.py), never as its bytes
    assert ("--export=ALL,NCCL_DEBUG=INFO,LOWBAND_SECRET_FILE=/shared/runs/mine/secret,"
            "LOWBAND_REPLICAS=2,LOWBAND_SHARDS=4,LOWBAND_RUN_DIR=/shared/runs/mine,"
            "LOWBAND_PROGRESS=0,") in script
    assert h.run_dir == Path("/shared/runs/mine")


def test_kubernetes_request_runs_the_script_through_the_agent():
    pytest.importorskip("kubernetes")
    h = lowband.launch(scheduler="kubernetes", image="registry.example/mine:1",
                       cfg={"queue": "default"}, **CLUSTER)
    job = yaml.safe_load(str(h.dryrun_info))
    tasks = job["spec"]["tasks"]
    assert [t["name"] for t in tasks] == ["node-0", "node-1"]
    for task in tasks:
        (c,) = task["template"]["spec"]["containers"]
        assert c["image"] == "registry.example/mine:1"
        command = " ".join(c["command"])
        assert "python3 -m lowband.launch torchrun --rdzv_conf" in command
        assert "--nnodes 2 --nproc_per_node 4" in command
        assert command.endswith("jobs/train_mine.py /shared/models/llama --lr 3e-4 --steps 100")
        env_ = {e["name"]: e["value"] for e in c["env"]}
        assert {k: env_[k] for k in ("LOWBAND_REPLICAS", "LOWBAND_SHARDS", "LOWBAND_RUN_DIR")} \
            == {"LOWBAND_REPLICAS": "2", "LOWBAND_SHARDS": "4",
                "LOWBAND_RUN_DIR": "/shared/runs/mine"}


def test_cli_script_dry_run(capsys):
    from lowband.cli import main

    assert main(["launch", "--dryrun", "-s", "slurm", "--script", "mine.py", "--replicas", "3",
                 "--shards", "2", "--run-dir", "/shared/r", "--foo", "1", "--", "--name", "x",
                 "--replicas", "9"]) == 0
    out = capsys.readouterr().out
    # flags lowband launch does not know, and everything after --, are the script's
    assert out.count("--nnodes 3 --nproc_per_node 2 --tee 3 --role '\"'\"''\"'\"' mine.py --foo 1 "
                     "--name x --replicas 9'") == 3, out
    assert out.count("LOWBAND_REPLICAS=3,LOWBAND_SHARDS=2,LOWBAND_RUN_DIR=/shared/r,") == 3


def test_hf_model_path_is_a_flag_and_lives_on_the_cluster(llama, tmp_path):
    h = lowband.launch(scheduler="slurm", model="hf:/cluster/models/llama", algo="streaming",
                       fragments=8, sync_every=16, run_dir="/shared/r", start=False)
    # not here: the nodes check it (its block count too)
    assert "--model hf:/cluster/models/llama --fragments 8 --sync-every 16" in \
        h.dryrun_info.request.materialize()
    h = lowband.launch(model=f"hf:{llama}", steps=2, run_dir=tmp_path / "r", start=False)
    assert f"--model hf:{llama}" in h.dryrun_info.request.role_params["node"][0].args[-1]
    with pytest.raises(ConfigError, match="model path '/nowhere/llama' does not exist"):
        lowband.launch(model="hf:/nowhere/llama", start=False)  # here: checked here


# -- what launch() refuses -------------------------------------------------------------------------

def test_a_module_object_is_refused_in_one_sentence():
    class Logits(nn.Module):
        def forward(self, x):
            return x

    for kwargs in ({}, {"script": "mine.py"}):
        with pytest.raises(ConfigError) as e:
            lowband.launch(model=Logits(), start=False, **kwargs)
        msg = str(e.value)
        assert msg == ("model= got a Logits object, and a module object cannot travel to the "
                       "job's processes: pass model=\"hf:PATH\" (a saved Hugging Face directory) "
                       "or script= a training script that builds it.")
    with pytest.raises(ConfigError, match=r"^data= got a list object, which cannot be a "
                                          r"command-line flag of the job"):
        lowband.launch(data=["a.txt", "b.txt"], start=False)
    with pytest.raises(ConfigError, match="cannot be a command-line argument"):
        lowband.launch(script="mine.py", script_args=[object()], start=False)
    with pytest.raises(ConfigError, match=r"^training script 'no-such.py' is not a file"):
        lowband.launch(script="no-such.py", start=False)
    with pytest.raises(ConfigError, match="^script_args= are the arguments of a training script"):
        lowband.launch(script_args=["--lr", "1"], start=False)
    with pytest.raises(ConfigError, match="make them equal"):
        lowband.launch(scheduler="slurm", script="x.py", replicas=2, nnodes=3, start=False)
    with pytest.raises(ConfigError, match="^replicas must be a positive integer, got 0"):
        lowband.launch(scheduler="slurm", script="x.py", replicas=0, start=False)


# -- the layout a script reads ---------------------------------------------------------------------

def test_layout_from_the_environment(monkeypatch, tmp_path):
    # the names a script's docs promise (lowband.options.ENV), the ones the component sets
    assert env.LAYOUT_ENV == ("LOWBAND_REPLICAS", "LOWBAND_SHARDS", "LOWBAND_RUN_DIR",
                              "LOWBAND_PROGRESS")
    assert components().LAYOUT_ENV is env.LAYOUT_ENV
    for var in components().LAYOUT_ENV:
        monkeypatch.delenv(var, raising=False)
    assert layout() == {}  # a plain torchrun: Config's own defaults
    assert launch_config(steps=3).replicas == 2
    monkeypatch.setenv("LOWBAND_REPLICAS", "4")
    monkeypatch.setenv("LOWBAND_SHARDS", "2")
    monkeypatch.setenv("LOWBAND_RUN_DIR", str(tmp_path / "r"))
    monkeypatch.setenv("LOWBAND_PROGRESS", "0")
    assert layout() == dict(replicas=4, shards=2, run_dir=str(tmp_path / "r"), progress=False)
    cfg = launch_config(algo="streaming", steps=7, progress=True)
    assert (cfg.replicas, cfg.shards, cfg.run_dir, cfg.algo, cfg.steps, cfg.progress) == (
        4, 2, str(tmp_path / "r"), "streaming", 7, True)
    assert launch_config(replicas=4).replicas == 4
    with pytest.raises(ConfigError, match="^replicas=2 contradicts the launched job's replicas=4"):
        launch_config(replicas=2)
    monkeypatch.setenv("LOWBAND_SHARDS", "two")
    with pytest.raises(ConfigError, match="LOWBAND_SHARDS='two' is not a whole number"):
        layout()
