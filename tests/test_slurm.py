"""lowband on a real Slurm cluster: Debian's slurmctld, two slurmd nodes, slurmdbd on MariaDB (so
sacct answers, as TorchX needs), munge, started here by lowband.testing.slurm_cluster (root, the
packages installed: .ci/run installs them). Each job is a heterogeneous TorchX job of two nodes
(three for the elastic one: Slurm gives each component of a heterogeneous job its own node)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torchx")

from lowband.testing.slurm_cluster import LocalSlurm, missing_tools  # noqa: E402
from lowband.telemetry import RunDir, read_events  # noqa: E402

# one small streaming run, the same in every test that compares losses
JOB = ["--link-bandwidth", "none", "--algo", "streaming", "--model", "nano", "--fragments", "2",
       "--seq-len", "32", "--batch-size", "4", "--eval-every", "0", "--eval-batches", "1", "--steps", "40",
       "--checkpoint-every", "10"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The local cluster (left as it was if it was already up), jobs submitted from a scratch
    directory, with this interpreter's python3 first on the nodes' PATH."""
    if os.name != "posix" or os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root")
    if missing_tools():
        pytest.skip(f"Slurm's Debian packages are not installed ({', '.join(missing_tools())})")
    slurm = LocalSlurm(nodes=3)  # an elastic job: the Lighthouse and two groups, a node each
    was_up = slurm.is_up()
    slurm.up()
    here = tmp_path_factory.mktemp("slurm-jobs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_CONF", str(slurm.conf))
        mp.setenv("PATH", os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
        mp.chdir(here)
        yield here
    if not was_up:
        slurm.down()


def launch_cli(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "lowband.cli", "launch", "-s", "slurm",
                           "--replicas", "2", "--cpu", "1", "--mem-mb", "2000", *args],
                          capture_output=True, text=True, timeout=timeout)


def wait_for(predicate, timeout=120, what="it"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def steps_of(run_dir, rank=0):
    path = RunDir(run_dir).event_file(rank)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()
            if '"kind":"step"' in line or '"kind":"checkpoint"' in line]


@pytest.fixture(scope="module")
def finished(cluster):
    """A 2-node streaming job followed with `lowband launch --wait`, the dashboard attached to
    its handle while it runs."""
    import lowband
    from lowband.dashboard.model import RunModel

    h = lowband.launch(JOB, scheduler="slurm", cpu=1, memMB=2000, run_dir="runs/plain")
    assert h.app_handle.startswith("slurm://")
    first = h.status()  # squeue knows the job at once: never 'unknown' after submission
    model = RunModel(h)
    wait_for(lambda: model.poll() > 0 or h.done, what="the first events")
    seen_live = model.events_seen if not h.summary() else 0
    assert h.wait(180) == "succeeded"
    return h, first, seen_live


def test_a_two_node_job_runs_to_its_summary(finished):
    h, first, seen_live = finished
    assert first in ("pending", "running")
    assert seen_live > 0  # the dashboard received events while the job ran
    assert h.status() == "succeeded"
    summary = h.summary()
    assert summary["steps"] == 40 and summary["replicas"] == 2
    logs = h.logs()
    assert "streaming R=2 S=1: loss" in logs  # the summary line, from the node that had rank 0
    assert {p.name for p in (h.run_dir / "logs").glob("node*.log")} == {"node0.log", "node1.log"}


def test_attach_from_a_fresh_process_reads_status_and_run_dir(finished):
    h, _, _ = finished
    code = ("from lowband.launch import attach; h = attach(%r, %r); "
            "print(h.status(), h.summary()['steps'])" % (h.app_handle, str(h.run_dir)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.split() == ["succeeded", "40"], out.stderr


def test_wait_from_the_command_line_and_a_killed_worker_names_its_node(cluster):
    killed = launch_cli("--wait", "--", *JOB, "--kill", "1:5")
    assert killed.returncode == 1
    # the node agent's sentence: node, global rank, how it ended, the node's log
    assert "worker rank 1 was killed by SIGKILL" in killed.stderr, killed.stderr
    line = next(ln for ln in killed.stderr.splitlines() if "worker rank 1 was killed" in ln)
    assert "node" in line and "its log: runs/" in line and line.rstrip(".").endswith(".log")
    assert "slurm://torchx/" in killed.stderr and "failed" in killed.stderr


def test_cancel_ends_a_running_job(cluster):
    import lowband

    h = lowband.launch([*JOB, "--steps", "100000"], scheduler="slurm", cpu=1, memMB=2000)
    wait_for(lambda: steps_of(h.run_dir), what="the first step")
    h.cancel()
    wait_for(lambda: h.status() != "running", timeout=60, what="the cancel")
    assert h.status() == "cancelled"


def test_a_requeued_job_resumes_from_its_checkpoint(cluster, finished):
    import lowband

    # replica 0 (whose events are read) made 30x slower, a sleep after each step that leaves
    # the arithmetic alone: the requeue must land before the job's last step, and a quiet
    # machine once ran steps 24 to 40 before Slurm's requeue took effect
    h = lowband.launch([*JOB, "--straggler", "0:30"], scheduler="slurm", cpu=1, memMB=2000,
                       run_dir="runs/requeued")
    wait_for(lambda: len([e for e in steps_of(h.run_dir) if e["kind"] == "step"]) >= 24,
             what="step 24")
    job = h.app_id
    subprocess.run(["scontrol", "requeue", job], check=True)  # what a preemption does

    held = []

    def started_again():  # Slurm holds a requeued job a while (BeginTime): start it at once
        state = h.status()
        if state == "pending":
            held.append(subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"],
                                       capture_output=True))
        return bool(held) and state == "running"

    wait_for(started_again, timeout=60, what="the requeued job to start again")
    assert h.wait(180) == "succeeded", h.logs(tail=20)
    events = steps_of(h.run_dir)
    first_ckpt = next(i for i, e in enumerate(events) if e["kind"] == "checkpoint")
    later = [e["step"] for e in events[first_ckpt:] if e["kind"] == "step"]
    assert min(later) > events[first_ckpt]["step"]  # never back below the first checkpoint
    runs = [e for e in read_events(h.run_dir, ("run",)) if e["rank"] == 0]
    resumed = [e for e in runs if e["phase"] == "resume"]
    assert [e["attempt"] for e in resumed] == [1] and resumed[0]["slurm_restart"] == 1
    assert resumed[0]["step"] in (20, 30) and resumed[0]["superseded_to"] >= 24
    kept = [e["step"] for e in read_events(h.run_dir, ("step",)) if e["rank"] == 0]
    assert kept == list(range(1, 41))  # readers see one history, the lost attempt dropped
    plain, _, _ = finished
    assert h.summary()["final_loss"] == plain.summary()["final_loss"]  # resume is bitwise


def test_an_elastic_job_restarts_a_killed_group_on_the_cluster(cluster):
    killed = launch_cli("--wait", "--run-dir", "runs/elastic", "--", *JOB[:-4], "--steps", "20",
                        "--elastic", "--checkpoint-every", "10", "--kill", "1:10")
    assert killed.returncode == 0, killed.stdout + killed.stderr
    summary = json.loads(Path("runs/elastic/summary.json").read_text())
    # group 1 was SIGKILLed in step 10 (before its checkpoint of step 10), restarted by its
    # agent afresh, healed from group 0
    el = summary["elastic"]
    assert (el["groups_finished"], el["restarts"], el["heals"]) == ([0, 1], {"1": 1}, {"1": 1})
    assert el["lost_work"] == [{"group": 1, "died_after": 9, "resumed_from": 0, "redone": None}]
    assert Path("runs/elastic/logs/group1.log").is_file()
