"""Checkpoints and resume: nothing lost, bitwise on CPU, for every algorithm."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import lowband, train_in_one_job
from lowband.algorithms import ALGORITHMS
from lowband.checkpoint import latest
from lowband.telemetry import RunDir, read_events

pytestmark = pytest.mark.slow  # measured (--durations): README, Run the tests

FLAGS = {  # per algorithm: a schedule with syncs both before and after the stop
    "diloco": ["--sync-every", "3"],
    "streaming": ["--sync-every", "4", "--fragments", "2", "--overlap", "1"],
    # adaptive counts follow the clock: not reproducible; 1:1 is two micro-batches a step, so
    # ddp's budget of --grad-accum 2 gives acco the same 10 steps
    "acco": ["--acco-micro", "1:1", "--grad-accum", "2"],
    "edit": ["--sync-every", "3"],
}
COMMON = ["--model", "nano", "--link-bandwidth", "none", "--steps", "10", "--seq-len", "32",
          "--batch-size", "4", "--warmup-steps", "2", "--eval-every", "0", "--checkpoint-every",
          "3", "--no-progress"]


def _same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# aedit syncs by wall-clock time: its replicas share no step to checkpoint at (it refuses
# --checkpoint-every), and its schedule follows the clock
ALGOS = sorted(set(ALGORITHMS) - {"aedit"})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Per algorithm, root/ALGO/whole: its 10 steps uninterrupted, and root/ALGO/part: stopped
    after 5; root/unsaved: a run without checkpoints. Returns root. All train in one job
    (train_in_one_job: the worker side of `lowband train`)."""
    root = tmp_path_factory.mktemp("resume")
    halves = [("whole", []), ("part", ["--stop-after", 5])]
    train_in_one_job(*[["--algo", algo, *FLAGS.get(algo, []), *COMMON, *stop,
                        "--run-dir", root / algo / name] for algo in ALGOS for name, stop in halves],
                     ["--algo", "ddp", *COMMON[:-3], "--no-progress", "--run-dir", root / "unsaved"])
    return root


@pytest.fixture(scope="module")
def resumed(trained):
    """(root, the checkpoint each part/ stopped at) once every part/ has been resumed
    (`--resume part`) in a second job: each resume starts in processes that never held its
    run, so all it has is the checkpoint, as after a crash."""
    stopped_at = {algo: latest(RunDir(trained / algo / "part")).name for algo in ALGOS}
    # with the progress bar (rank 0's stderr): a resumed bar starts at the steps done
    train_in_one_job(*[["--resume", trained / algo / "part", "--progress"] for algo in ALGOS])
    return trained, stopped_at


@pytest.mark.parametrize("algo", ALGOS)
def test_resume_is_bitwise_identical(resumed, algo):
    root, stopped_at = resumed
    assert stopped_at[algo] == "step-00000005"
    whole, part = root / algo / "whole", root / algo / "part"
    for name in ("model.pt", "outer.pt"):
        if (whole / name).exists():
            a = torch.load(whole / name, weights_only=True)
            b = torch.load(part / name, weights_only=True)
            assert _same_tensors(a, b), name
    # the events continue in the same files, each step once
    steps = [e["step"] for e in read_events(part, ("step",)) if e["rank"] == 0]
    assert steps == list(range(1, 11))
    # the run's training clock goes on from the checkpoint's: up to the summary's wall time
    clock = [e["elapsed_s"] for e in read_events(part, ("step", "eval")) if e["rank"] == 0]
    assert all(a < b for a, b in zip(clock[:-1], clock[1:-1])) and clock[-2] <= clock[-1]
    assert clock[-1] == json.loads((part / "summary.json").read_text())["wall_s"]
    assert len(list((part / "checkpoints").iterdir())) == 3  # keep the last 3


def test_crash_mid_checkpoint_keeps_the_previous_one(tmp_path):
    proc = lowband("train", "--algo", "streaming", *FLAGS["streaming"], *COMMON,
                   "--crash-checkpoint", "6", "--run-dir", "r", cwd=tmp_path)
    assert proc.returncode != 0
    run = RunDir(tmp_path / "r")
    assert latest(run).name == "step-00000003"
    assert (run.checkpoints / "step-00000006.tmp").exists()  # written, never made current
    resumed = lowband("train", "--resume", "r", "--no-progress", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert latest(run).name == "step-00000010"


def test_resume_errors(tmp_path, trained, lowband_here):
    # refused by the flags' parse, before any worker starts: cli.main in this process
    code, stderr = lowband_here("train", "--resume", "nowhere", cwd=tmp_path)
    assert code == 2 and "not a lowband run directory" in stderr
    unsaved = trained / "unsaved"  # a run trained without --checkpoint-every
    code, stderr = lowband_here("train", "--resume", unsaved, "--lr", "1", cwd=tmp_path)
    assert code == 2 and "--lr cannot be given" in stderr
    assert "Traceback" not in stderr
    proc = lowband("train", "--resume", unsaved, cwd=tmp_path)  # refused by its workers
    assert proc.returncode == 2 and "has no checkpoint" in proc.stderr


def test_killed_worker_then_resume(tmp_path):
    parent = subprocess.Popen([sys.executable, "-m", "lowband.cli", "train", "--algo", "streaming",
                               *FLAGS["streaming"], *COMMON[:2], "--steps", "100000",
                               "--checkpoint-every", "2", "--no-progress", "--link-bandwidth",
                               "none", "--run-dir", "r"],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = RunDir(tmp_path / "r")
    deadline = time.time() + 120
    while (latest(run) is None or latest(run).name < "step-00000004") and time.time() < deadline:
        time.sleep(0.2)
    victim = [int(p) for p in os.listdir("/proc") if p.isdigit() and _is_rank(int(p), tmp_path, 1)]
    assert victim
    os.kill(victim[0], signal.SIGKILL)
    t0 = time.time()
    _, err = parent.communicate(timeout=60)
    assert time.time() - t0 < 60 and parent.returncode != 0
    assert "worker rank 1 was killed by SIGKILL" in err
    at = int(latest(run).name.split("-")[1])
    resumed = lowband("train", "--resume", "r", "--steps", str(at + 2), "--no-progress", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    steps = [e["step"] for e in read_events(run, ("step",)) if e["rank"] == 0]
    assert steps == list(range(1, at + 3))


def _is_rank(pid: int, cwd, rank: int) -> bool:
    try:
        cmd = open(f"/proc/{pid}/cmdline").read()
        env = open(f"/proc/{pid}/environ").read()
        return ("lowband.cli" in cmd and f"RANK={rank}\0" in env
                and os.path.realpath(f"/proc/{pid}/cwd") == os.path.realpath(cwd))
    except OSError:
        return False
