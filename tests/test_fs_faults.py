"""Faults of the filesystem (docs/faults.md, "When the disk is full, read-only or gone"): a file
where the run directory should be, a read-only filesystem, a disk that fills mid-run. Each ends
in one sentence naming the path and the fix, exit status 2 (before the run) or 3 (a run that
stopped), no traceback, and no result file half-written; a run refused before its first step
leaves no directory it made. The disks are small tmpfs mounts (root; skipped elsewhere)."""

import contextlib
import os
import subprocess
from pathlib import Path

import pytest
import torch

from lowband.cli import main
from lowband.telemetry import RunDir

TINY = ["--model", "nano", "--steps", "2", "--seq-len", "32", "--batch-size", "2",
        "--eval-every", "0", "--eval-batches", "1", "--link-bandwidth", "none", "--no-progress"]
DDP = ["train", "--algo", "ddp", "--replicas", "1", *TINY]
# a nano run's model.pt and outer.pt are about 470 kB each; its config and events a few kB
NO_MODEL = "size=200k"           # the run starts, model.pt does not fit
NO_OUTER = "size=700k"           # model.pt fits, outer.pt does not


@contextlib.contextmanager
def tmpfs(where: Path, options: str):
    """A tmpfs mounted on `where` for the block (root only: skipped elsewhere), always unmounted."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs (a full or read-only disk) needs root")
    where.mkdir(exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


@pytest.fixture
def lowband_fd(capfd, monkeypatch):
    """lowband's main in this process, from `cwd`: (exit status, stderr), the workers' stderr
    (rank 0 writes to the terminal) included."""

    def run(*args, cwd):
        monkeypatch.chdir(cwd)
        capfd.readouterr()
        code = main([str(a) for a in args])
        return code, capfd.readouterr().err

    return run


def one_sentence(stderr: str) -> str:
    """The error's one line (beside notes, and the line naming a started run's directory)."""
    lines = [line for line in stderr.splitlines() if line.strip() and not
             line.startswith(("lowband: note: ", "lowband: run directory "))]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith("lowband: error: ") and lines[0].endswith("."), lines[0]
    return lines[0]


def stray(root: Path) -> list[str]:
    """Temporary files left anywhere under root (atomic writes' *.tmp<pid>, checkpoints' .tmp)."""
    return [str(p) for p in root.rglob("*") if ".tmp" in p.name]


def test_a_file_as_run_dir_is_refused_and_untouched(tmp_path, lowband_fd):
    (tmp_path / "afile").write_text("mine\n")
    for given in ("afile", "afile/run"):
        code, err = lowband_fd(*DDP, "--run-dir", given, cwd=tmp_path)
        assert code == 2
        assert one_sentence(err) == ("lowband: error: afile is a file where a directory should "
                                     "be: give another path, or move the file away.")
    assert (tmp_path / "afile").read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_a_refused_run_leaves_no_directory(tmp_path, lowband_fd):
    (tmp_path / "kept").mkdir()
    (tmp_path / "tiny.txt").write_bytes(b"x" * 300)  # too small for 2 shards of 128 tokens
    refused = [(["--data", "tiny.txt", "--seq-len", "128"], "is too small")]
    if not torch.cuda.is_available():  # (a GPU machine takes --device cuda)
        refused.append((["--device", "cuda"], "no CUDA device"))
    for flags, why in refused:
        for run_dir in (["--run-dir", "new/run"], ["--run-dir", "kept"], []):
            code, err = lowband_fd("train", *TINY, *flags, *run_dir, cwd=tmp_path)
            assert code == 2 and why in one_sentence(err)
            assert sorted(p.name for p in tmp_path.iterdir()) == ["kept", "tiny.txt"]
            assert not any((tmp_path / "kept").iterdir())  # there before: kept, as it was


def test_a_worker_refusal_removes_the_directories_its_launcher_made(tmp_path, monkeypatch,
                                                                    capsys):
    """A refusal a worker makes (after its launcher made the run directory) removes the
    directories the launcher made for the run, unless a step was taken in them."""
    from lowband.flags import parse_train
    from lowband.launch import here

    steps = []

    class Refused:
        def __init__(self, argv, world, run, **kw):
            self.run = run

        def wait(self):  # rank 1 refuses before its first step, as a worker does
            (self.run.logs / "rank1.log").write_text("lowband: error: rank 1 says no.\n")
            self.run.event_file(1).write_text(''.join(steps))
            return 2, 1

    monkeypatch.setattr(here, "LocalJob", Refused)
    monkeypatch.chdir(tmp_path)
    argv = [*TINY, "--algo", "ddp", "--replicas", "1"]
    for run_dir in (["--run-dir", "a/b/run"], []):
        code, _ = here.train_here(parse_train([*argv, *run_dir])[0], argv)
        assert code == 2 and "rank 1 says no" in capsys.readouterr().err
        assert list(tmp_path.iterdir()) == []
    steps.append('{"v":1,"t":1,"rank":1,"replica":0,"kind":"step","step":1}\n')
    code, _ = here.train_here(parse_train([*argv, "--run-dir", "a/run"])[0], argv)
    assert code == 2 and RunDir(tmp_path / "a" / "run").trained()  # a step taken: kept


@pytest.mark.slow
def test_a_run_directory_removed_mid_run_stops_in_one_sentence(tmp_path):
    """The run directory removed while the run trains (its events still go to the files it
    holds open): the run stops at its next write there with one sentence, exit status 3."""
    import shutil
    import sys
    import time

    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "lowband.cli", *DDP, "--steps", "3", "--pause",
                             "0:1:2", "--run-dir", str(run)], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (run / "events" / "rank0.jsonl").exists() or \
            b'"kind":"fault"' not in (run / "events" / "rank0.jsonl").read_bytes():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    shutil.rmtree(run)  # during step 1's pause
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    assert "its directory was removed while the run was writing to it" in one_sentence(err)
    assert not run.exists()


@pytest.mark.root
def test_a_read_only_directory(tmp_path, lowband_fd):
    from lowband.testing.synthetic import make_run

    make_run(tmp_path / "done", steps=10)
    with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        code, err = lowband_fd(*DDP, cwd=ro)  # the default runs/<algo>-<time>
        assert code == 2 and one_sentence(err) == (
            "lowband: error: runs is on a read-only filesystem: give a path on a writable one "
            "(--run-dir, --dir, -o), or run from a writable directory.")
        code, err = lowband_fd("compare", "--algos", "ddp,streaming", "--no-report", *TINY,
                               cwd=ro)
        assert code == 2 and one_sentence(err).startswith(
            "lowband: error: compare is on a read-only filesystem: ")
        pytest.importorskip("plotly")
        code, err = lowband_fd("report", tmp_path / "done", "-o", "ro/report.html", cwd=tmp_path)
        assert code == 2 and one_sentence(err).startswith(
            "lowband: error: ro/report.html is on a read-only filesystem: ")
        assert list(ro.iterdir()) == []


@pytest.mark.root
@pytest.mark.parametrize("algo, size, missing", [
    ("ddp", NO_MODEL, ["model.pt"]),
    pytest.param("streaming", NO_OUTER, ["outer.pt"], marks=pytest.mark.slow),  # two workers
    ("ddp-checkpoint", NO_MODEL, ["model.pt", "checkpoints/step-00000001"]),
])
def test_a_disk_that_fills_mid_run(tmp_path, lowband_fd, algo, size, missing):
    """The run stops with one sentence (exit status 3) and leaves no truncated result: model.pt,
    outer.pt and summary.json are whole or absent, a checkpoint is whole or absent, no
    temporary file is left."""
    flags = ["--algo", algo.split("-")[0], "--replicas", "1" if algo.startswith("ddp") else "2"]
    if algo.endswith("checkpoint"):
        flags += ["--checkpoint-every", "1"]
    with tmpfs(tmp_path / "disk", size) as disk:
        code, err = lowband_fd("train", *TINY, *flags, "--run-dir", "disk/run", cwd=tmp_path)
        assert code == 3
        assert one_sentence(err) == (
            f"lowband: error: no space left on the device of disk/run (writing {missing[-1]}): "
            "free space, or give --run-dir on another disk; results are written whole or not "
            "at all, and the run's last checkpoint, if any, is intact.")
        run = RunDir(disk / "run")
        assert run.config.exists() and not run.summary.exists()
        assert not any((run.root / name).exists() for name in missing)
        if (run.root / "model.pt").exists():  # whole: it loads
            assert torch.load(run.root / "model.pt", weights_only=True)
        assert stray(disk) == []


@pytest.mark.root
def test_report_on_a_full_disk_leaves_no_half_page(tmp_path, lowband_fd):
    pytest.importorskip("plotly")
    from lowband.testing.synthetic import make_run

    make_run(tmp_path / "done", steps=10)
    with tmpfs(tmp_path / "disk", "size=64k") as disk:
        code, err = lowband_fd("report", "done", "-o", "disk/report.html", cwd=tmp_path)
        assert code == 2 and one_sentence(err) == (
            "lowband: error: no space left on the device of disk/report.html: free space, or "
            "write on another disk.")
        assert list(disk.iterdir()) == []
