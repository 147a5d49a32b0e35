"""A run stopped by SIGTERM or SIGUSR1 (checkpoint/preempt.py): every rank stops after the same
step with a checkpoint, even without --checkpoint-every and when only one rank got the signal;
one sentence and exit status 5 say where and how to go on; `--resume` then ends bitwise where an
uninterrupted run ends. Also Ctrl-C's sentence, and `lowband launch -s slurm --requeue`."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import lowband, train_in_one_job
from lowband.checkpoint import latest
from lowband.checkpoint.preempt import interrupted, requeue_job
from lowband.options import PREEMPTED
from lowband.telemetry import RunDir, read_events

# replica 0 made 6x slower (a sleep after each step, the arithmetic untouched): the signal lands
# mid-run; no --checkpoint-every
STEPS = 20
FLAGS = ["--algo", "streaming", "--model", "nano", "--link-bandwidth", "none", "--steps",
         str(STEPS), "--seq-len", "32", "--batch-size", "4", "--eval-every", "0", "--sync-every",
         "4", "--fragments", "2", "--warmup-steps", "2", "--straggler", "0:6", "--no-progress"]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The same run uninterrupted."""
    run = tmp_path_factory.mktemp("whole") / "r"
    train_in_one_job([*FLAGS, "--run-dir", run])
    return run


def start(cwd) -> subprocess.Popen:
    """`lowband train` as a user starts it, once its rank 0 has taken step 3."""
    proc = subprocess.Popen([sys.executable, "-m", "lowband.cli", "train", *FLAGS, "--run-dir",
                             "r"], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    events, deadline = RunDir(cwd / "r").event_file(0), time.monotonic() + 60
    while not (events.exists() and '"kind":"step","step":3,' in events.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    return proc


def worker(parent: int, rank: int) -> int:
    """The pid of `lowband train`'s worker of this rank."""
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ") as f:
                env = f.read()
        except OSError:
            continue
        if ppid == parent and f"RANK={rank}\0" in env:
            return pid
    raise AssertionError(f"no worker of rank {rank}")


def _same(a, b) -> bool:
    a, b = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_signalled_run_stops_checkpointed_and_resumes_bitwise(whole, tmp_path):
    proc = start(tmp_path)
    proc.send_signal(signal.SIGTERM)  # to `lowband train` itself, which passes it on
    _, err = proc.communicate(timeout=120)
    run = RunDir(tmp_path / "r")
    at = int(latest(run).name.split("-")[1])
    assert proc.returncode == PREEMPTED and 3 <= at < STEPS, err
    assert "lowband: run directory r; its logs: r/logs\n" in err, err  # before the workers
    said = (f"lowband: stopped by SIGTERM at step {at} of {STEPS}; checkpoint "
            f"r/checkpoints/step-{at:08d}; continue with: lowband train --resume r\n")
    assert err.endswith(said) and err.count("stopped by") == 1, err  # the sentence once
    checkpoints = [(e["rank"], e["step"]) for e in read_events(run, ("checkpoint",))]
    assert sorted(checkpoints) == [(0, at), (1, at)]
    assert not (run.root / "summary.json").exists()
    resumed = lowband("train", "--resume", "r", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert f"lowband: resuming r from step {at} (checkpoint step-{at:08d})\n" in resumed.stderr
    for name in ("model.pt", "outer.pt"):
        assert _same(whole / name, run.root / name), name
    steps = [e["step"] for e in read_events(run, ("step",)) if e["rank"] == 0]
    assert steps == list(range(1, STEPS + 1))  # each once: the events go on in the same files


@pytest.mark.slow
def test_sigusr1_to_one_worker_stops_every_rank_at_one_step(tmp_path):
    proc = start(tmp_path)
    os.kill(worker(proc.pid, 1), signal.SIGUSR1)  # rank 1 alone, as a node's signal would
    _, err = proc.communicate(timeout=120)
    run = RunDir(tmp_path / "r")
    at = int(latest(run).name.split("-")[1])
    assert proc.returncode == PREEMPTED, err
    assert f"lowband: stopped by SIGUSR1 at step {at} of {STEPS}; checkpoint " in err  # rank 0's
    assert f"stopped by SIGUSR1 at step {at} of {STEPS}" in (run.logs / "rank1.log").read_text()
    checkpoints = [(e["rank"], e["step"]) for e in read_events(run, ("checkpoint",))]
    assert sorted(checkpoints) == [(0, at), (1, at)]
    last = {r: max(e["step"] for e in read_events(run, ("step",)) if e["rank"] == r)
            for r in (0, 1)}
    assert last == {0: at, 1: at}
    # Ctrl-C's sentence (the launcher's, after it killed the workers): where, and what resumes
    assert interrupted(run) == (f"lowband: interrupted at step {at}; resume from checkpoint "
                                f"step {at} with --resume {run.root}.")
    (run.root / "checkpoints" / f"step-{at:08d}").rename(run.root / "elsewhere")
    assert interrupted(run) == (f"lowband: interrupted at step {at}; no checkpoint: nothing to "
                                "resume.")


def test_the_requeue_decision():
    job = {"LOWBAND_REQUEUE": "1", "SLURM_JOB_ID": "12"}
    assert requeue_job(signal.SIGUSR1, job) == "12"  # the time limit's warning
    assert requeue_job(signal.SIGTERM, job) is None  # scancel; a preemption Slurm requeues
    assert requeue_job(signal.SIGUSR1, {"SLURM_JOB_ID": "12"}) is None  # not asked for
    assert requeue_job(signal.SIGUSR1, {"LOWBAND_REQUEUE": "1"}) is None  # not on Slurm
    # a heterogeneous job (TorchX's, a component a node) is requeued as a whole, by its first
    assert requeue_job(signal.SIGUSR1, {**job, "SLURM_JOB_ID_HET_GROUP_0": "11"}) == "11"


def test_slurm_requeue_request(tmp_path, lowband_here):
    pytest.importorskip("torchx")
    import lowband

    h = lowband.launch(["--model", "nano"], scheduler="slurm", requeue=120, start=False,
                       run_dir=tmp_path / "r")
    script = h.dryrun_info.request.materialize()
    assert script.count("--requeue") == 2 and script.count("--signal=USR1@120") == 2
    assert script.count("LOWBAND_REQUEUE=1") == 2  # every node's workers
    code, err = lowband_here("launch", "--dryrun", "--requeue", "--model", "nano", cwd=tmp_path)
    assert code == 2 and "give -s slurm" in err and err.count("\n") == 1
    code, err = lowband_here("launch", "--dryrun", "-s", "slurm", "--requeue", "0", "--model",
                             "nano", cwd=tmp_path)
    assert code == 2 and "give a positive whole number" in err
