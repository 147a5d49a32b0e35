"""A bounded wait at the syncs (--grace, algorithms/grace.py): a replica that stalls delays the
others once, by the grace window; its work merges later, every replica keeps the same outer
state, and nothing changes where nobody is late."""

import json

import pytest
import torch

from conftest import train_in_one_job
from lowband.config import Config, ConfigError
from lowband.dashboard.model import RunModel
from lowband.dashboard.replicas import replicas_table
from lowband.telemetry import read_events

COMMON = ["--model", "nano", "--link-bandwidth", "none", "--seq-len", "32", "--batch-size", "4",
          "--warmup-steps", "2", "--no-progress", "--algo", "streaming", "--sync-every", "8",
          "--fragments", "2", "--overlap", "1", "--local-steps", "1,1", "--steps", "64",
          "--eval-every", "16", "--checkpoint-every", "16"]  # a sync every 4 steps
PAUSE = 2.5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """root/NAME for: replica 1 stalled PAUSE s after step 14 (mid-period: its sync 4, at step
    16, is late) with a 0.3 s window, in a run long enough to rejoin; the same without a stall,
    with and without --grace, and with it stopped at run step 32 and resumed; of three
    replicas, two stalled at once."""
    root = tmp_path_factory.mktemp("grace")
    train_in_one_job([*COMMON, "--steps", "1000", "--eval-every", "200", "--checkpoint-every",
                      "200", "--grace", "0.3s", "--pause", f"1:14:{PAUSE}",
                      "--run-dir", root / "paused"],
                     [*COMMON, "--grace", "5s", "--run-dir", root / "graced"],
                     [*COMMON, "--grace", "5s", "--stop-after", "32", "--run-dir", root / "part"],
                     [*COMMON, "--run-dir", root / "plain"],
                     [*COMMON, "--replicas", "3", "--local-steps", "1,1,1", "--steps", "1000",
                      "--eval-every", "200", "--checkpoint-every", "200", "--grace", "0.3s",
                      "--pause", f"1:14:{PAUSE},2:18:{PAUSE}", "--run-dir", root / "two"])
    train_in_one_job(["--resume", root / "part", "--no-progress"])
    return root


def test_a_stalled_replica_delays_the_others_once_by_the_window(runs):
    paused = runs / "paused"
    summary = json.loads((paused / "summary.json").read_text())
    assert summary["outer_states_agree"] is True
    fast, slow = summary["steps_run_per_replica"]
    assert fast == 1000 and slow < fast  # the stalled replica lost its stall's steps
    times = [e["t"] for e in read_events(paused, ("step",)) if e["replica"] == 0]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert max(gaps) < PAUSE - 1.0, max(gaps)  # a 0.3 s window (5x margin: a loaded machine)
    late = read_events(paused, ("late",))
    assert [(e["replica"], e["sync"]) for e in late] == [(1, 4)]
    rejoin, = read_events(paused, ("rejoin",))
    assert rejoin["replica"] == 1 and rejoin["missed"][0] == 4 and rejoin["carried_tokens"] > 0
    assert rejoin["late_s"] > PAUSE - 1.0
    syncs = read_events(paused, ("sync",))
    absent = [e["step"] for e in syncs if e["replica"] == 0 and e["absent"] == [1]]
    assert absent and absent[0] == 16
    missed = [e["step"] for e in syncs if e["replica"] == 1 and e.get("missed")]
    assert missed == absent  # the late replica applied every sync it missed, as the others did
    # it took part again: a later sync with nobody absent, where everyone evaluated
    met = [e["step"] for e in syncs if e["replica"] == 1 and e["step"] > absent[-1]
           and not e["absent"]]
    evals = {e["step"] for e in read_events(paused, ("eval",)) if e["replica"] == 1}
    assert met and evals - {1000} <= set(met) and len(evals) >= 2
    # the dashboard's and the report's replicas table counts the syncs each missed
    model = RunModel(paused).load()
    assert [r.missed for r in model.replica_work()] == [0, len(missed)]
    assert "missed syncs" in replicas_table([model])


def test_two_stalled_replicas_of_three_delay_the_third_once(runs):
    """Replicas 1 and 2 stall at about the same time (after steps 14 and 18): each stand-in
    gives up on its own, neither waits for the other, and the third goes on."""
    two = runs / "two"
    summary = json.loads((two / "summary.json").read_text())
    assert summary["outer_states_agree"] is True and summary["steps_run_per_replica"][0] == 1000
    times = [e["t"] for e in read_events(two, ("step",)) if e["replica"] == 0]
    assert max(b - a for a, b in zip(times, times[1:])) < PAUSE - 1.0
    assert sorted(e["replica"] for e in read_events(two, ("late",))) == [1, 2]
    assert sorted(e["replica"] for e in read_events(two, ("rejoin",))) == [1, 2]


def _same(a, b) -> bool:
    for name in ("model.pt", "outer.pt"):
        x, y = torch.load(a / name, weights_only=True), torch.load(b / name, weights_only=True)
        if x.keys() != y.keys() or not all(torch.equal(x[k], y[k]) for k in x):
            return False
    return True


def test_nobody_late_changes_nothing_and_a_resume_is_bitwise(runs):
    """--grace where no replica is late: the same weights, bitwise, as without it; stopped at a
    checkpoint and resumed, the same again."""
    a = runs / "graced"
    assert _same(a, runs / "plain") and _same(a, runs / "part")
    assert not read_events(a, ("late", "rejoin"))
    checkpoints = {e["step"] for e in read_events(a, ("checkpoint",))}
    assert checkpoints == {16, 32, 48, 64}


@pytest.mark.parametrize("options, says", [
    ({"grace": "2s"}, "needs --local-steps adaptive"),
    ({"grace": "soon", "local_steps": "adaptive"}, "cannot read the duration"),
    ({"grace": "0s", "local_steps": "adaptive"}, "must be a positive duration"),
    ({"grace": "2s", "local_steps": "adaptive", "shards": 2}, "needs --shards 1"),
    ({"grace": "2s", "local_steps": "adaptive", "time_budget": 60}, "needs no --time-budget"),
    ({"grace": "2s", "local_steps": "adaptive", "replicas": 4, "exchange": "two-phase"},
     "needs --exchange all-gather or auto"),
])
def test_bad_input_gets_one_sentence(options, says):
    with pytest.raises(ConfigError) as e:
        Config.from_dict({"algo": "streaming", **options}).validate()
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_stand_in_that_stops_is_an_error_not_a_hang():
    """The training thread waits for its stand-in to start an exchange: if the stand-in died
    instead, the wait raises its error (it does not hang)."""
    from types import SimpleNamespace

    from lowband.algorithms.grace import Met

    with pytest.raises(RuntimeError, match="stand-in stopped before sync 3: KeyError"):
        Met(3, SimpleNamespace(error=KeyError("outer:grace"))).wait()
