"""Checkpoints and resume: nothing lost, bitwise on CPU, for every algorithm."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import lowband
from lowband.algorithms import ALGORITHMS
from lowband.checkpoint import latest
from lowband.telemetry import RunDir, read_events

FLAGS = {  # per algorithm: a schedule with syncs both before and after the stop
    "diloco": ["--sync-every", "3"],
    "streaming": ["--sync-every", "4", "--fragments", "2", "--overlap", "1"],
    # adaptive counts follow the clock: not reproducible; 1:1 is two micro-batches a step, so
    # ddp's budget of --grad-accum 2 gives acco the same 10 steps
    "acco": ["--acco-micro", "1:1", "--grad-accum", "2"],
    "edit": ["--sync-every", "3"],
}
COMMON = ["--model", "nano", "--steps", "10", "--seq-len", "32", "--batch-size", "4",
          "--warmup-steps", "2", "--eval-every", "0", "--checkpoint-every", "3", "--no-progress"]


def _same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# aedit syncs by wall-clock time: its replicas share no step to checkpoint at (it refuses
# --checkpoint-every), and its schedule follows the clock
@pytest.mark.parametrize("algo", sorted(set(ALGORITHMS) - {"aedit"}))
def test_resume_is_bitwise_identical(tmp_path, algo):
    flags = ["--algo", algo, *FLAGS.get(algo, []), *COMMON]
    whole = lowband("train", *flags, "--run-dir", "whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    part = lowband("train", *flags, "--stop-after", "5", "--run-dir", "part", cwd=tmp_path)
    assert part.returncode == 0, part.stderr
    assert latest(RunDir(tmp_path / "part")).name == "step-00000005"
    resumed = lowband("train", "--resume", "part", "--no-progress", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    for name in ("model.pt", "outer.pt"):
        if (tmp_path / "whole" / name).exists():
            a = torch.load(tmp_path / "whole" / name, weights_only=True)
            b = torch.load(tmp_path / "part" / name, weights_only=True)
            assert _same_tensors(a, b), name
    # the events continue in the same files, each step once
    steps = [e["step"] for e in read_events(tmp_path / "part", ("step",)) if e["rank"] == 0]
    assert steps == list(range(1, 11))
    assert len(list((tmp_path / "part" / "checkpoints").iterdir())) == 3  # keep the last 3


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


def test_resume_errors(tmp_path):
    proc = lowband("train", "--resume", "nowhere", cwd=tmp_path)
    assert proc.returncode == 2 and "not a lowband run directory" in proc.stderr
    ok = lowband("train", *COMMON[:-3], "--no-progress", "--run-dir", "r", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    proc = lowband("train", "--resume", "r", cwd=tmp_path)
    assert proc.returncode == 2 and "has no checkpoint" in proc.stderr
    proc = lowband("train", "--resume", "r", "--lr", "1", cwd=tmp_path)
    assert proc.returncode == 2 and "--lr cannot be given" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_killed_worker_then_resume(tmp_path):
    parent = subprocess.Popen([sys.executable, "-m", "lowband.cli", "train", "--algo", "streaming",
                               *FLAGS["streaming"], *COMMON[:2], "--steps", "100000",
                               "--checkpoint-every", "2", "--no-progress", "--run-dir", "r"],
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
