"""Fault injectors: a straggler replica and a corrupted one, with any algorithm."""

import statistics

import pytest

from conftest import lowband
from lowband.telemetry import read_events


@pytest.mark.slow
def test_straggler_and_corruption(train_run):
    run = train_run("--algo", "diloco", "--model", "nano", "--steps", 12, "--sync-every", 4,
                    "--straggler", "1:3", "--corrupt", "1:6:5", "--eval-every", 0,
                    "--link-bandwidth", "none")
    events = read_events(run)
    steps = {r: [e for e in events if e["kind"] == "step" and e["rank"] == r] for r in (0, 1)}
    # 3x: its compute, then twice that asleep (medians: one step of the fast rank slowed by the
    # machine moves a mean of 12)
    slow = statistics.median(e["compute_s"] for e in steps[1])
    fast = statistics.median(e["compute_s"] for e in steps[0])
    assert slow >= 2 * fast
    faults = [e for e in events if e["kind"] == "fault"]
    assert [(e["rank"], e["step"], e["what"]) for e in faults] == [(1, 6, "corrupt")]
    loss = {e["step"]: e["loss"] for e in steps[1]}
    assert loss[7] > 1.5 * loss[6]  # the corrupted replica's loss jumps
    ref = {e["step"]: e["loss"] for e in steps[0]}
    assert ref[7] < 1.2 * ref[6]  # the other does not


@pytest.mark.parametrize("flag,value,message", [
    ("--straggler", "1", "REPLICA:FACTOR"), ("--straggler", "5:2", "replica must be in 0..1"),
    ("--straggler", "1:0.5", "factor at least 1"), ("--corrupt", "1:x", "REPLICA:STEP"),
    ("--corrupt", "0:999", "the step in 1..200")])
def test_bad_fault_flags(tmp_path, flag, value, message):
    proc = lowband("train", flag, value, cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_non_finite_pseudo_gradient_never_reaches_outer_parameters(train_run):
    import torch

    run = train_run("--algo", "diloco", "--model", "nano", "--steps", 8, "--sync-every", 4,
                    "--corrupt", "1:3:1e45", "--eval-every", 0, "--codec", "fp4-e3m0",
                    "--link-bandwidth", "none", "--guard", "off")  # (the guard's own: test_guard)
    skips = [e for e in read_events(run, ("skip",))]
    assert {(e["rank"], e["what"]) for e in skips} >= {(0, "pseudo-gradient"), (1, "pseudo-gradient")}
    outer = torch.load(run.root / "outer.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in outer.values())
    local = torch.load(run.root / "model.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in local.values())


@pytest.mark.slow
def test_too_many_skips_stop_the_run(tmp_path):
    proc = lowband("train", "--algo", "ddp", "--link-bandwidth", "none", "--model", "nano",
                   "--steps", 50, "--lr", "1e30", "--warmup-steps", 0, "--max-skips", 3,
                   "--no-progress", cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert "4 updates in a row held NaN or inf" in proc.stderr and "Traceback" not in proc.stderr
