"""Heterogeneity you can emulate: slowdowns that come and go (--slowdown) and a replica that
stalls for a while (--pause), lowband/faults.py."""

import statistics
from types import SimpleNamespace

import pytest

from conftest import lowband
from lowband.config import Config, ConfigError
from lowband.faults import Faults, Slowdown, parse_pause, parse_slowdown, slowdown_windows
from lowband.telemetry import read_events


def test_the_flags_are_read():
    assert parse_slowdown("1:4:10,1:2:5:20,0:3:1", 2) == [
        Slowdown(1, 4.0, 10.0, 30.0, 0), Slowdown(1, 2.0, 5.0, 20.0, 1),
        Slowdown(0, 3.0, 1.0, 3.0, 0)]
    assert parse_pause("1:20:30,0:5:0.5", 2, 100) == [(1, 20, 30.0), (0, 5, 0.5)]
    assert parse_slowdown("", 2) == [] and parse_pause("", 2, 100) == []


@pytest.mark.parametrize("flag,value,message", [
    ("slowdown", "1:0.5:10", "the factor at least 1"),
    ("slowdown", "2:4:10", "the replica must be in 0..1"),
    ("slowdown", "1:4:-1", "the seconds and the gap positive"),
    ("slowdown", "1:4:10:0", "the seconds and the gap positive"),
    ("slowdown", "1:4", "write it as REPLICA:FACTOR:SECONDS[:GAP]"),
    ("pause", "1:5:-2", "the seconds positive"),
    ("pause", "3:5:2", "the replica must be in 0..1"),
    ("pause", "1:21:2", "the step in 1..20"),
    ("pause", "1:5", "write it as REPLICA:STEP:SECONDS")])
def test_bad_input_is_one_sentence(flag, value, message):
    with pytest.raises(ConfigError) as refused:
        Config(replicas=2, steps=20, **{flag: value}).validate()
    text = str(refused.value)
    assert message in text and "\n" not in text and text.endswith(".")


def test_a_refused_flag_writes_nothing(tmp_path):
    proc = lowband("train", "--no-progress", "--run-dir", tmp_path / "run", "--steps", 20,
                   "--pause", "1:21:2", cwd=tmp_path)
    assert proc.returncode == 2 and "the step in 1..20" in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_the_schedule_is_seeded_and_repeats():
    slow = Slowdown(1, 4.0, 2.0, 6.0)
    windows = slowdown_windows(slow, seed=0, until=3000)
    assert windows == slowdown_windows(slow, seed=0, until=3000)  # the same in every process
    assert windows != slowdown_windows(slow, seed=1, until=3000)
    assert windows != slowdown_windows(Slowdown(0, 4.0, 2.0, 6.0), seed=0, until=3000)
    assert windows != slowdown_windows(Slowdown(1, 4.0, 2.0, 6.0, 1), seed=0, until=3000)
    assert all(end - start == pytest.approx(2.0) for start, end in windows)
    gaps = [b[0] - a[1] for a, b in zip(windows, windows[1:])]
    assert min(gaps) > 0 and 5.0 < statistics.mean(gaps) < 7.0  # ~375 of them: mean 6 +- 5%
    assert windows[-1][0] < 3000 <= slowdown_windows(slow, seed=0, until=4000)[len(windows)][0]


class Recorder:
    def __init__(self):
        self.events = []

    def emit(self, kind, **fields):
        self.events.append({"kind": kind, **fields})


def _faults(replica, **flags):
    cfg = SimpleNamespace(replicas=2, steps=1000, elastic=False, crash_checkpoint=0,
                          **{"straggler": "", "slowdown": "", "pause": "", "corrupt": "",
                             "kill": "", **flags})
    return Faults(cfg, replica, seed=7)


def test_steps_sleep_by_the_slowdowns_on_and_the_events_say_when(monkeypatch):
    slept = []
    monkeypatch.setattr("lowband.faults.time.sleep", slept.append)
    faults, rec = _faults(1, straggler="1:2", slowdown="1:3:1:2,0:5:1"), Recorder()
    (start, end), following = slowdown_windows(Slowdown(1, 3.0, 1.0, 2.0), 7, 1000)[:2]
    ticks = [start - 0.1, start + 0.1, end - 0.1, end + 0.01, following[0] + 0.01]
    for step, t in enumerate(ticks, 1):
        assert faults.slow_down(step, 0.5, t, rec) == 0.0
    # the straggler's 2 always, times 3 inside a window (replica 0's slowdown is not this one's)
    assert slept == pytest.approx([0.5, 2.5, 2.5, 0.5, 2.5])
    assert [(e["step"], e["what"], e["phase"], e["factor"], e["seconds"]) for e in rec.events] == [
        (2, "slowdown", "start", 3.0, 1.0), (4, "slowdown", "end", 3.0, 1.0),
        (5, "slowdown", "start", 3.0, 1.0)]
    assert [e["elapsed_s"] for e in rec.events] == [ticks[1], ticks[3], ticks[4]]
    # a resumed run (a fresh Faults at the clock's seconds) is inside the same window
    resumed, rec2 = _faults(1, slowdown="1:3:1:2"), Recorder()
    slept.clear()
    resumed.slow_down(9, 0.5, ticks[4], rec2)
    assert slept == pytest.approx([1.0]) and rec2.events[0]["phase"] == "start"


def test_a_pause_is_slept_once_and_returned(monkeypatch):
    slept = []
    monkeypatch.setattr("lowband.faults.time.sleep", slept.append)
    faults, rec = _faults(0, pause="0:3:4,1:3:9,0:5:2"), Recorder()
    stalls = [faults.slow_down(step, 0.1, float(step), rec) for step in range(1, 7)]
    assert slept == [4.0, 2.0]  # replica 1's pause is not this replica's
    assert [s > 0 for s in stalls] == [False, False, True, False, True, False]
    assert [(e["step"], e["what"], e["seconds"]) for e in rec.events] == [(3, "pause", 4.0),
                                                                          (5, "pause", 2.0)]


def test_a_run_records_its_pause_and_slowdowns(train_run):
    pause = 1.5
    run = train_run("--algo", "diloco", "--model", "nano", "--steps", 20, "--sync-every", 4,
                    "--link-bandwidth", "none", "--seq-len", 32, "--batch-size", 4,
                    "--eval-every", 0, "--pause", f"1:5:{pause}", "--slowdown", "0:3:0.05:0.05")
    events = read_events(run)
    faults = [e for e in events if e["kind"] == "fault"]
    assert [(e["rank"], e["step"], e["seconds"]) for e in faults if e["what"] == "pause"] == [
        (1, 5, pause)]
    slow = [e for e in faults if e["what"] == "slowdown"]
    assert slow and {e["replica"] for e in slow} == {0}
    assert [e["phase"] for e in slow] == ["start", "end"] * (len(slow) // 2) + \
        ["start"] * (len(slow) % 2)
    windows = slowdown_windows(Slowdown(0, 3.0, 0.05, 0.05), 0, 10_000)
    for on, off in zip(slow[::2], slow[1::2] + [None]):  # each start lies in a window of the
        window = [w for w in windows if w[0] <= on["elapsed_s"] < w[1]]  # schedule, its end
        assert len(window) == 1, on                                       # past that window
        assert off is None or off["step"] > on["step"] and off["elapsed_s"] >= window[0][1]
    # the stall is wall time, neither the step's time nor its compute
    step = {e["step"]: e for e in events if e["kind"] == "step" and e["rank"] == 1}
    assert step[5]["step_s"] < pause and step[5]["compute_s"] < pause
    assert step[5]["elapsed_s"] - step[4]["elapsed_s"] >= pause
