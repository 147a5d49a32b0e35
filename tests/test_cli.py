"""The CLI end to end: the main job, its run directory, bad input, a dying worker."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import lowband
from lowband.telemetry import read_events

FIELDS = {
    "step": {"step", "loss", "lr", "tokens", "step_s", "compute_s", "elapsed_s"},
    "comm": {"op", "group", "tag", "payload_bytes", "wire_bytes", "codec", "start", "end"},
    "eval": {"step", "val_loss", "elapsed_s", "tokens", "outer_bytes"},
    "run": {"phase", "world", "config_hash"},
}
SUMMARY = {"algorithm", "replicas", "shards", "steps", "tokens", "wall_s", "tokens_per_s",
           "compute_s", "compute_utilization", "outer_wire_bytes", "inner_wire_bytes",
           "peak_outer_payload_bytes", "final_loss", "final_val_loss"}


@pytest.mark.slow
def test_main_job_small(tmp_path):
    proc = lowband("train", "--algo", "ddp", "--link-bandwidth", "none", "--model", "nano",
                   "--steps", 12, "--eval-every", 5, "--target-loss", 100, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("run directory: runs/ddp-")
    assert "loss" in lines[1] and "tokens/s" in lines[1] and "outer link" in lines[1]
    assert "target val loss 100 reached at step 5" in lines[1]
    run = tmp_path / lines[0].split(": ", 1)[1]
    summary = json.loads((run / "summary.json").read_text())
    assert SUMMARY <= set(summary)
    assert summary["steps"] == 12 and summary["replicas"] == 2
    assert summary["tokens"] == 12 * 2 * 8 * 128
    assert summary["outer_wire_bytes"] > 0 and summary["inner_wire_bytes"] == 0
    assert 0 < summary["compute_utilization"] <= 1
    config = json.loads((run / "config.json").read_text())
    assert config["algo"] == "ddp" and config["meta"]["world"] == 2

    events = read_events(run)
    for e in events:
        assert {"v", "t", "rank", "replica", "kind"} <= set(e)
        assert FIELDS.get(e["kind"], set()) <= set(e), e
    kinds = {(e["rank"], e["kind"]) for e in events}
    assert kinds == {(r, k) for r in (0, 1) for k in FIELDS}
    steps = [e for e in events if e["kind"] == "step" and e["rank"] == 0]
    assert [e["step"] for e in steps] == list(range(1, 13))
    assert [e["step"] for e in events if e["kind"] == "eval" and e["rank"] == 0] == [5, 10, 12]
    last = summary["final_val_loss"]
    assert abs(last - sum(e["val_loss"] for e in events if e["kind"] == "eval" and e["step"] == 12) / 2) < 1e-9

    # what each evaluation took: the same run-wide numbers on every rank, the last one the
    # summary's totals, the clock that of the slowest rank's step events
    evals = {(e["step"], e["rank"]): e for e in events if e["kind"] == "eval"}
    took = {s: [(evals[s, r]["elapsed_s"], evals[s, r]["tokens"], evals[s, r]["outer_bytes"])
                for r in (0, 1)] for s in (5, 10, 12)}
    assert all(a == b for a, b in took.values())
    assert took[12][0] == (summary["wall_s"], summary["tokens"], summary["outer_wire_bytes"])
    assert [took[s][0][1] for s in (5, 10)] == [5 * 2 * 8 * 128, 10 * 2 * 8 * 128]
    assert 0 < took[5][0][2] < took[10][0][2] < took[12][0][2]  # ddp sends every step
    clock = {(e["step"], e["rank"]): e["elapsed_s"] for e in events if e["kind"] == "step"}
    assert took[5][0][0] == max(clock[5, 0], clock[5, 1]) < took[10][0][0]
    # --target-loss 100: the first evaluation reaches it
    assert summary["target"] == {"loss": 100.0, "reached": True, "step": 5,
                                 "val_loss": (evals[5, 0]["val_loss"] + evals[5, 1]["val_loss"]) / 2,
                                 "elapsed_s": took[5][0][0], "tokens": took[5][0][1],
                                 "outer_bytes": took[5][0][2]}


@pytest.mark.slow
def test_every_run_writes_its_report(tmp_path, capsys, monkeypatch):
    """`lowband train` with flags ends with the report it wrote into its run directory; without
    plotly (the ui extra) with one sentence naming the extra, and exit status 0."""
    from lowband.cli import main

    monkeypatch.chdir(tmp_path)
    tiny = ["train", "--algo", "ddp", "--replicas", "1", "--model", "nano", "--steps", "2",
            "--seq-len", "32", "--batch-size", "2", "--eval-every", "0", "--eval-batches", "1",
            "--no-progress", "--run-dir"]
    assert main([*tiny, "a"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "report: a/report.html"
    assert (tmp_path / "a" / "report.html").stat().st_size > 1_000_000
    for name in ["plotly", *(m for m in sys.modules if m.startswith("plotly."))]:
        monkeypatch.setitem(sys.modules, name, None)   # as in an install without the ui extra
    assert main([*tiny, "b"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == ("report: not written: the HTML report needs the ui extra (plotly is not "
                    "installed): pip install 'lowband[ui]', then `lowband report b -o "
                    "b/report.html`.")
    assert (tmp_path / "b" / "summary.json").exists()
    assert not (tmp_path / "b" / "report.html").exists()


def test_config_file_and_flags_override(tmp_path):
    (tmp_path / "run.toml").write_text('algo = "ddp"\nlink_bandwidth = "none"\nmodel = "nano"\n'
                                       'steps = 50\nseq_len = 32\nreplicas = 1\n')
    proc = lowband("train", "--config", "run.toml", "--steps", 3, "--run-dir", "r", "--no-progress",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert (config["model"], config["steps"], config["seq_len"], config["replicas"]) == ("nano", 3, 32, 1)


BAD = [
    (["--algo", "nope"], "unknown algorithm 'nope'"),
    (["--model", "huge"], "unknown model 'huge'"),
    (["--data", "/no/such/file.txt"], "does not exist"),
    (["--steps", "0"], "--steps must be a positive integer"),
    (["--batch-size", "-3"], "--batch-size must be a positive integer"),
    (["--lr", "0"], "--lr must be positive"),
    (["--steps", "many"], "invalid int value"),
    (["--no-such-flag"], "unrecognized arguments"),
    (["--config", "bad.toml"], "unknown key 'stepz'"),
    (["--config", "missing.toml"], "does not exist"),
    (["--algo", "streaming", "--sync-every", "8", "--fragments", "2", "--overlap", "4"],
     "--overlap 4 must be at least 0 and below H/P = 4"),
    (["--algo", "streaming", "--fragments", "8", "--sync-every", "16"], "more than the model's 4 blocks"),
    (["--algo", "streaming", "--alpha", "1.5"], "--alpha must lie in [0, 1]"),
    (["--algo", "streaming", "--sync-every", "10", "--fragments", "4"], "is not a multiple of"),
    (["--algo", "diloco", "--fragments", "2"], "use --algo streaming"),
    (["--algo", "streaming", "--codec", "fp8"], "unknown codec 'fp8'"),
    (["--link-bandwidth", "fast"], "cannot read the bandwidth 'fast'"),
    (["--link-bandwidth", "0"], "--link-bandwidth must be positive, got '0': give none for no"),
    (["--link-latency", "soon"], "--link-latency: cannot read the duration 'soon'"),
    (["--fragment-pattern", "random"], "is not one of strided, sequential"),
    (["--target-loss", "-1"], "--target-loss must be a finite validation loss (or 0 for none), got -1.0."),
    (["--target-loss", "nan"], "--target-loss must be a finite validation loss (or 0 for none), got nan."),
    (["--target-loss", "inf"], "--target-loss must be a finite validation loss"),
    (["--elastic", "--target-loss", "3"], "--target-loss is not measured for --elastic runs"),
]


@pytest.mark.parametrize("args,message", BAD)
def test_bad_input_one_sentence_exit_2(tmp_path, args, message, lowband_here):
    """The first case as a user meets it (a process of its own); the others in this process, as
    the same cli.main the process runs (each process would spend ~2 s importing torch)."""
    (tmp_path / "bad.toml").write_text("stepz = 3\n")
    if args is BAD[0][0]:
        proc = lowband("train", *args, cwd=tmp_path)
        code, stderr = proc.returncode, proc.stderr
    else:
        code, stderr = lowband_here("train", *args, cwd=tmp_path)
    assert code == 2
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert message in stderr
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written


def test_world_mismatch_under_torchrun(tmp_path):
    env = {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    proc = lowband("train", "--replicas", 2, "--shards", 1, cwd=tmp_path, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "make R x S equal the world size" in proc.stderr and proc.stderr.count("\n") == 1


@pytest.mark.slow
def test_worker_side_error_stops_everyone(tmp_path):
    (tmp_path / "tiny.txt").write_bytes(b"x" * 300)  # too small for 4 shards of 64 tokens
    proc = lowband("train", "--data", "tiny.txt", "--replicas", 4, "--seq-len", 64,
                   "--model", "nano", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "too small" in proc.stderr
    assert _workers_of(tmp_path) == []


def _workers_of(cwd) -> list[int]:
    out = subprocess.run(["pgrep", "-f", "lowband.cli train"], capture_output=True, text=True).stdout
    pids = [int(p) for p in out.split()]
    return [p for p in pids if os.path.realpath(f"/proc/{p}/cwd") == os.path.realpath(cwd)]


@pytest.mark.slow
def test_killed_worker_stops_the_job(tmp_path):
    parent = subprocess.Popen([sys.executable, "-m", "lowband.cli", "train", "--algo", "ddp",
                               "--link-bandwidth", "none", "--model", "nano", "--steps", "100000",
                               "--no-progress", "--run-dir", "r"],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    events = tmp_path / "r" / "events" / "rank1.jsonl"
    deadline = time.time() + 120
    while not (events.exists() and '"step"' in events.read_text()) and time.time() < deadline:
        time.sleep(0.2)
    victim = [p for p in _workers_of(tmp_path) if p != parent.pid
              and "RANK=1\0" in open(f"/proc/{p}/environ").read()]
    assert victim, "rank 1 is not running"
    os.kill(victim[0], signal.SIGKILL)
    t0 = time.time()
    out, err = parent.communicate(timeout=60)
    assert time.time() - t0 < 15
    assert parent.returncode != 0
    assert "worker rank 1 was killed by SIGKILL" in err
    # rank 0 (this terminal's) outlived it: no traceback of its failed collective, the sentence first
    assert "Traceback" not in err and err.startswith(
        "lowband: run directory r; its logs: r/logs\nlowband: error: worker rank 1"), err
    assert _workers_of(tmp_path) == []


def test_every_user_error_ends_a_command_the_same_way(monkeypatch, capsys):
    """Each error a user can cause or must be told of is a lowband.options.UserError, and the
    one handler in cli.py prints its sentence (`lowband: error: ...`, or a stop's own label) and
    returns its exit status, whichever command raised it."""
    from lowband import cli
    from lowband.comm.membership.elastic import ElasticStopped
    from lowband.compare.runner import CompareStopped
    from lowband.config import ConfigError
    from lowband.options import UserError
    from lowband.plan import PlanError
    from lowband.report import ReportError

    cases = [(ConfigError("--steps must be positive."), "lowband: error: --steps must", 2),
             (PlanError("give --step-time."), "lowband: error: give --step-time.", 2),
             (ReportError("r is not a run."), "lowband: error: r is not a run.", 2),
             (ElasticStopped("no quorum."), "lowband: no quorum.", 3),
             (CompareStopped("the run a failed.", 5), "lowband: the run a failed.", 5)]
    for error, says, code in cases:
        assert isinstance(error, UserError)

        def command(argv, error=error):
            raise error

        monkeypatch.setitem(cli.COMMANDS, "plan", command)
        assert cli.main(["plan"]) == code
        captured = capsys.readouterr()
        assert captured.err.startswith(says) and captured.err.count("\n") == 1, captured.err
