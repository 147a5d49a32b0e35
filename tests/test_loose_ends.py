"""The edges of a run: how workers leave, a run directory used twice, one run event a rank, and
damaged checkpoints."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import lowband, train_in_one_job
from lowband.checkpoint import complete
from lowband.launch.local import free_port
from lowband.telemetry import RunDir, read_events

pytestmark = pytest.mark.slow  # measured (--durations): README, Run the tests

TINY = ["--algo", "ddp", "--link-bandwidth", "none", "--model", "nano", "--seq-len", "32",
        "--batch-size", "4", "--eval-every", "0", "--eval-batches", "1", "--no-progress"]

# Some machines (torch 2.13, gloo, a DeviceMesh, async all-reduces) abort a finished worker
# while the interpreter tears down ("terminate called without an active exception"). This
# makes every worker's interpreter teardown abort, on any machine.
ABORT_AT_EXIT = """\
import atexit, os
if os.environ.get("LOWBAND_WORKER") == "1":
    atexit.register(os.abort)
"""


def _run_events(run: RunDir) -> dict[int, list[str]]:
    """Each rank's run events, as their phases in order."""
    phases: dict[int, list[str]] = {}
    for e in read_events(run, ("run",)):
        phases.setdefault(e["rank"], []).append(e["phase"])
    return phases


def _steps(run: RunDir, rank: int = 0) -> list[int]:
    return [e["step"] for e in read_events(run, ("step",)) if e["rank"] == rank]


def _lowband_together(*argvs, cwd, timeout=300) -> list[subprocess.CompletedProcess]:
    """conftest.lowband for each ARGV, all started at once: independent runs (each its own run
    directory) whose start-ups share the cores that one alone leaves idle."""
    procs = []
    try:
        for k, argv in enumerate(argvs):
            with open(cwd / f"together{k}.out", "w") as out, \
                    open(cwd / f"together{k}.err", "w") as err:  # no pipe to fill while we wait
                procs.append(subprocess.Popen([sys.executable, "-m", "lowband.cli", *map(str, argv)],
                                              cwd=cwd, stdout=out, stderr=err))
        return [subprocess.CompletedProcess(proc.args, proc.wait(timeout=timeout),
                                            (cwd / f"together{k}.out").read_text(),
                                            (cwd / f"together{k}.err").read_text())
                for k, proc in enumerate(procs)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_every_finished_run_exits_0(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(ABORT_AT_EXIT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    for pair in range(2):  # 4 short runs, two at a time
        procs = {}
        for k in range(2):
            name = f"r{pair}{k}"
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "lowband.cli", "train", *TINY, "--steps", "2",
                 "--run-dir", name], cwd=tmp_path, env=env, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"{name}: {out}{err}"
            run = RunDir(tmp_path / name)
            assert json.loads(run.summary.read_text())["steps"] == 2
            assert (run.root / "model.pt").exists()
            assert _run_events(run) == {0: ["start", "end"], 1: ["start", "end"]}


@pytest.fixture(scope="module")
def first_runs(tmp_path_factory) -> dict:
    """The runs the next tests start from, trained as `lowband train`'s workers train them, in
    one set of worker processes (conftest.train_in_one_job); each test works on its own copy."""
    root = tmp_path_factory.mktemp("first")
    flags = {"holding": ["--steps", "5", "--checkpoint-every", "5"],
             "damaged": ["--steps", "6", "--checkpoint-every", "3", "--keep-checkpoints", "2"]}
    train_in_one_job(*([*TINY, *more, "--run-dir", root / name] for name, more in flags.items()))
    return {name: root / name for name in flags}


def _copy_of(run_dir, to) -> RunDir:
    shutil.copytree(run_dir, to, symlinks=True)
    return RunDir(to)


def test_a_run_directory_holding_a_run_is_refused_or_overwritten(tmp_path, first_runs,
                                                                 lowband_here):
    run = _copy_of(first_runs["holding"], tmp_path / "r")  # 5 steps, a checkpoint of step 5
    before = {p: p.read_bytes() for p in (run.summary, run.event_file(0), run.event_file(1))}

    # refused by the launcher before any worker starts (cli.launch_local): its main, here
    code, stderr = lowband_here("train", *TINY, "--steps", "5", "--run-dir", "r", cwd=tmp_path)
    assert code == 2
    assert stderr.strip().splitlines() == [
        "lowband: error: r already holds a run: pass --overwrite to replace it, --resume r to "
        "continue it, or another --run-dir."]
    assert {p: p.read_bytes() for p in before} == before  # nothing of the old run lost
    assert [c.name for c in complete(run)] == ["step-00000005"]

    over = lowband("train", *TINY, "--steps", "3", "--run-dir", "r", "--overwrite", cwd=tmp_path)
    assert over.returncode == 0, over.stderr
    assert _steps(run, 0) == _steps(run, 1) == [1, 2, 3]
    assert _run_events(run) == {0: ["start", "end"], 1: ["start", "end"]}
    assert not run.checkpoints.exists() or not any(run.checkpoints.iterdir())
    assert json.loads(run.summary.read_text())["steps"] == 3


def _torchrun(*args, cwd):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "lowband.cli", "train", *TINY, *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_under_torchrun_rank_0_refuses_or_overwrites(tmp_path):
    run = RunDir(tmp_path / "old").create()  # what an earlier run left
    run.summary.write_text('{"steps": 7}\n')
    run.event_file(0).write_text('{"v":1,"t":1,"rank":0,"replica":0,"kind":"step","step":1}\n')
    (run.logs / "rank1.log").write_text("old\n")

    refused = _torchrun("--steps", "2", "--run-dir", "old", cwd=tmp_path)
    assert refused.returncode != 0
    assert "old already holds a run: pass --overwrite to replace it" in refused.stderr
    assert not re.search(r'File "[^"]*lowband[/\\]', refused.stderr)  # torchrun's own only
    assert run.summary.read_text() == '{"steps": 7}\n'

    over = _torchrun("--steps", "2", "--run-dir", "old", "--overwrite", cwd=tmp_path)
    assert over.returncode == 0, over.stderr
    assert json.loads(run.summary.read_text())["steps"] == 2
    assert _steps(run, 0) == [1, 2]
    assert not (run.logs / "rank1.log").exists()


def _damage(file):
    file.write_bytes(os.urandom(100))


def test_a_damaged_checkpoint_is_passed_over_or_refused(tmp_path, first_runs):
    run = _copy_of(first_runs["damaged"], tmp_path / "r")  # 6 steps, checkpoints every 3, keep 2
    old, new = complete(run)
    assert (old.name, new.name) == ("step-00000003", "step-00000006")
    recorded = json.loads((new / "manifest.json").read_text())["sha256"]
    assert recorded.keys() == {p.name for p in new.iterdir()} - {"manifest.json"}
    distcp = sorted(new.glob("*.distcp"))[0]
    _damage(distcp)
    (old / "manifest.json").unlink()  # as written before checksums: taken as it is

    resumed = lowband("train", "--resume", "r", "--steps", "8", "--no-progress", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert (f"lowband: checkpoint {new.relative_to(tmp_path)} is damaged ({distcp.name} does not "
            "match its checksum), so the run resumes from step-00000003.") in resumed.stderr
    assert "Traceback" not in resumed.stderr
    assert _steps(run) == list(range(1, 9))
    assert _run_events(run) == {r: ["start", "resume", "end"] for r in (0, 1)}

    for path in complete(run):  # step 6 (written again) and step 8
        distcp = sorted(path.glob("*.distcp"))[-1]
        _damage(distcp)
    bare = _copy_of(run.root, tmp_path / "bare")  # the same damage without checksums, beside it
    for path in complete(bare):  # without checksums the damage shows in the load: one sentence
        (path / "manifest.json").unlink()
    refused, failed = _lowband_together(
        ["train", "--resume", "r", "--steps", "10", "--no-progress"],
        ["train", "--resume", "bare", "--steps", "10", "--no-progress"], cwd=tmp_path)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"lowband: error: every checkpoint of r is damaged (the newest, step-00000008: "
        f"{distcp.name} does not match its checksum), so nothing can be "
        "resumed: start the run again with --overwrite."]
    assert failed.returncode == 2
    assert "step-00000008 cannot be loaded" in failed.stderr and "Traceback" not in failed.stderr


def test_a_sentence_stopping_every_rank_is_told_from_rank_0_though_rank_1_stopped_first():
    """decided_by_rank0 stops every rank with rank 0's sentence; rank 0's goes to the terminal,
    the others' to their logs. When rank 1 exits first, the job still names rank 0 (whose
    sentence is already on the terminal), so the sentence is not told twice."""
    import time

    from lowband.launch.local import LocalJob

    class Worker:
        def __init__(self, code, at):
            self.code, self.at = code, at

        def poll(self):
            return self.code if time.monotonic() >= self.at else None

        def kill(self):
            self.code, self.at = -9, 0

        def wait(self, timeout=None):
            return self.poll()

    now = time.monotonic()
    job = LocalJob.__new__(LocalJob)
    job.procs, job._logs, job._stopping_since = [Worker(2, now + 0.5), Worker(2, now)], [], None
    assert job.wait() == (2, 0)
    job.procs, job._stopping_since = [Worker(None, now + 60), Worker(2, now)], None
    begun = time.monotonic()  # rank 0 never stops by itself: it is stopped after a moment
    assert job.wait() == (2, 1) and 2.5 < time.monotonic() - begun < 10
