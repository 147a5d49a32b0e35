"""lowband on a real Slurm cluster: Debian's slurmctld, two slurmd nodes, slurmdbd on MariaDB (so
sacct answers, as TorchX needs), munge, started here by lowband.testing.slurm_cluster (root, the
packages installed: .ci/run installs them). Each job is a heterogeneous TorchX job of two nodes
(Slurm gives each component of a heterogeneous job its own node); the elastic one is a job for
the Lighthouse and one for each of its three groups (launch/slurm.py), with a spare node."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.slurm]
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
    slurm = LocalSlurm(nodes=5)  # an elastic job: the Lighthouse, three groups and a spare node
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
    # Slurm's requeue sends SIGTERM: the workers stop together with a checkpoint where the
    # check read after the next period's first step says so (checkpoint/preempt.py), or, if
    # the signal came in the run's last period, finish as planned (their final checkpoint)
    at = resumed[0]["step"]
    assert at in (20, 30, 31, 40) and resumed[0].get("superseded_to", at) >= max(at, 24), resumed
    kept = [e["step"] for e in read_events(h.run_dir, ("step",)) if e["rank"] == 0]
    assert kept == list(range(1, 41))  # readers see one history, the lost attempt dropped
    plain, _, _ = finished
    assert h.summary()["final_loss"] == plain.summary()["final_loss"]  # resume is bitwise


def test_an_elastic_job_survives_a_node_lost_for_good(cluster):
    """--elastic on Slurm: the Lighthouse's job and a Slurm job a group (launch/slurm.py). Group
    1's worker is SIGKILLed in step 10 (--kill: its agent restarts it); group 2's node is lost for
    good mid-run: its slurmd and every process of its job SIGKILLed (LocalSlurm.lose_node), then
    marked DOWN as a node health check would (Slurm's own SlurmdTimeout would take 30 s more).
    Slurm fails and requeues that job alone, the Lighthouse lifts the requeue's hold, and the
    group starts on the spare node, continues from its checkpoint and heals from a live peer."""
    import lowband

    slurm = LocalSlurm(nodes=5)
    # a slow emulated outer link (a sleep, not work) paces the run at about 0.13 s a step
    # whatever the machine's load, so the survivors still train when group 2 is back
    h = lowband.launch([*JOB[:-4], "--link-bandwidth", "500kbit", "--link-latency", "0ms",
                        "--steps", "400", "--checkpoint-every", "20", "--elastic", "--kill",
                        "1:10"], scheduler="slurm", replicas=3, cpu=2, memMB=2000,
                       run_dir="runs/elastic")
    wait_for(lambda: len([e for e in steps_of(h.run_dir, 2) if e["kind"] == "step"]) >= 30,
             timeout=150, what="group 2's step 30")
    jobs = dict(line.split() for line in subprocess.run(
        ["squeue", "-h", "-o", "%j %i"], capture_output=True, text=True).stdout.splitlines())
    node = subprocess.run(["squeue", "-h", "-j", jobs["group2-0"], "-o", "%N"],
                          capture_output=True, text=True).stdout.strip()
    assert slurm.lose_node(node) == [jobs["group2-0"]]  # the Lighthouse is elsewhere
    lost_at = [e["step"] for e in steps_of(h.run_dir, 2) if e["kind"] == "step"][-1]
    try:
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=lost"],
                       check=True)
        assert h.wait(240) == "succeeded", h.logs(tail=20)
    finally:
        slurm.revive_node(node)  # (ReturnToService=2: back once its slurmd registers)
        wait_for(slurm.is_up, timeout=60, what=f"{node} back")
    el = h.summary()["elastic"]
    assert el["groups_finished"] == [0, 1, 2] and el["restarts"] == {"1": 1, "2": 1}
    assert el["heals"].get("1") == 1 and el["heals"].get("2", 0) >= 1, el
    one, two = el["lost_work"]  # group 1 killed in step 10, before its first checkpoint
    assert one == {"group": 1, "died_after": 9, "resumed_from": 0, "redone": None}
    assert two["group"] == 2 and lost_at - 1 <= two["died_after"] <= lost_at + 1
    # its newest checkpoint: the last at or before the step it died after, or (lost in the
    # middle of writing that very one, whose step event came first) the one before
    newest = 20 * (two["died_after"] // 20)
    assert two["resumed_from"] in (newest, newest - 20 if two["died_after"] % 20 == 0 else newest)
    runs = [e for e in read_events(h.run_dir, ("run",)) if e["rank"] == 2]
    assert [(e["phase"], e.get("restart"), e.get("slurm_restart")) for e in runs] == [
        ("start", None, None), ("resume", True, 1), ("end", None, None)]
    history = subprocess.run(["sacct", "-n", "-X", "-D", "-P", "-j", jobs["group2-0"], "-o",
                              "State,NodeList"], capture_output=True, text=True).stdout.split()
    assert history[0] == f"NODE_FAIL|{node}" and history[-1].startswith("COMPLETED|"), history
    assert history[-1] != f"COMPLETED|{node}"  # placed on the spare node
    # group 0 ran every step once, group 1 (healed at a sync after its kill) none twice; all
    # three end with the same outer parameters
    kept = {r: [e["step"] for e in read_events(h.run_dir, ("step",)) if e["rank"] == r]
            for r in (0, 1)}
    assert kept[0] == list(range(1, 401)) and kept[1] == sorted(set(kept[1]))
    outer = {json.loads(p.read_text())["outer_sha256"] for p in (h.run_dir / "groups").iterdir()}
    assert len(outer) == 1
    said = Path(f"slurm-{h.app_id}-lighthouse-0.err").read_text()
    assert f"replica group 2 lost its node: Slurm requeued job {jobs['group2-0']}" in said
    assert Path("runs/elastic/logs/group2.log").is_file()
