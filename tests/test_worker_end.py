"""How a failed job's workers end: the workers that outlive a dead one stay quiet (no traceback),
and a worker's refusal under torchrun is the sentence torchrun's closing summary names."""

import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from lowband import cli
from lowband.config import ConfigError
from lowband.launch.local import PEER_LOST, free_port, peer_lost, quiet_end
from lowband.options import WORKER_ENV

GLOO = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:34224. This is typically caused by a remote worker crashing.")


def _raised_from(cause: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as inner:
            raise ValueError("while averaging the buckets") from inner
    except ValueError as e:
        return e


@pytest.mark.parametrize("exc, lost", [
    (RuntimeError(GLOO), True),
    (RuntimeError("[pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer"), True),
    (dist.DistBackendError("NCCL communicator was aborted"), True),
    (dist.DistNetworkError("failed to recv, got 0 bytes"), True),
    (_raised_from(RuntimeError(GLOO)), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"), False),
    (ValueError("connection closed by peer"), False),  # not a collective's error
    (KeyError("step"), False),
])
def test_a_collective_failed_by_a_lost_peer_is_told_from_a_bug(exc, lost):
    assert peer_lost(exc) is lost


def _stderr_of_quiet_end(exc, to_log: bool, tmp_path, monkeypatch) -> str:
    """quiet_end's output with fd 2 a file (a worker's log) or a pipe (the shared terminal)."""
    monkeypatch.setattr(sys, "stderr", open(2, "w", closefd=False))  # fd 2, not pytest's
    saved = os.dup(2)
    if to_log:
        sink = open(tmp_path / "rank1.log", "w+")
        os.dup2(sink.fileno(), 2)
    else:
        r, w = os.pipe()
        os.dup2(w, 2)
    try:
        code = quiet_end(exc)
        sys.stderr.flush()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    assert code == PEER_LOST
    if to_log:
        sink.seek(0)
        return sink.read()
    os.close(w)
    with os.fdopen(r) as f:
        return f.read()


def test_a_worker_that_outlived_a_dead_one_says_one_line_in_its_log_only(tmp_path, monkeypatch):
    monkeypatch.setenv(WORKER_ENV, "1")
    monkeypatch.setenv("RANK", "1")

    def said(to_log: bool) -> str:
        return _stderr_of_quiet_end(RuntimeError(GLOO), to_log, tmp_path, monkeypatch)

    line = said(True)
    assert line == ("lowband: worker rank 1 stopped: another worker went away during a collective "
                    "(RuntimeError: Connection closed by peer [127.0.0.1]:34224)\n")
    # rank 0 on the terminal `lowband train` shares: the launcher's sentence comes first, alone
    assert said(False) == ""
    monkeypatch.delenv(WORKER_ENV)  # under torchrun its output is its own: the line again
    assert "stopped: another worker" in said(False)


def test_a_refusal_is_what_torchruns_summary_names(tmp_path, monkeypatch, capsys):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    assert cli.refused(ConfigError("make R x S equal the world size.")) == 2
    assert json.loads(error_file.read_text())["message"]["message"] == \
        "lowband: error: make R x S equal the world size."
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    summary = str(ChildFailedError("lowband.cli", {0: failure})).strip().splitlines()
    assert summary[-2] == "  traceback : lowband: error: make R x S equal the world size."


def test_torchrun_ends_with_the_workers_sentence(tmp_path):
    """A real torchrun of 2 processes for a job of 3 ranks: refused at start, and the last lines
    torchrun prints (its failure summary, after its own traceback) name lowband's sentence."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "lowband.cli",
         "train", "--replicas", "3", "--steps", "2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    sentence = ("lowband: error: --replicas 3 x --shards 1 = 3 ranks, but the job has 2 processes: "
                "make R x S equal the world size.")
    last = proc.stderr.strip().splitlines()[-3:]
    assert any(line.strip() == f"traceback : {sentence}" for line in last), proc.stderr
