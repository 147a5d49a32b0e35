"""A-EDiT (--algo aedit): replicas sync by time windows, not step counts. A straggler's windows
hold fewer of its steps; a step budget (R x --steps) and a --time-budget hold, and the summary
tells each replica's steps. (EDiT's numerics against the float64 reference: test_edit.py.)"""

import pytest

from lowband.telemetry import read_events

BATCH, SEQ = 2, 32


def sync_events(run, rank=0):
    return [e for e in read_events(run, ("sync",)) if e["rank"] == rank]


@pytest.mark.slow
def test_aedit_straggler_syncs_by_time(train_run):
    # the warm-up's two synchronous steps take the first steps' one-off costs out of the windows
    run = train_run("--algo", "aedit", "--model", "nano", "--replicas", 2, "--steps", 100000,
                    "--sync-seconds", 1.5, "--time-budget", 6, "--warmup-sync-steps", 2,
                    "--straggler", "1:4", "--batch-size", 4, "--seq-len", 64, "--eval-every", 0,
                    "--link-bandwidth", "none")
    syncs = [e for e in sync_events(run) if e["block"] == "root"]
    assert len(syncs) >= 3
    # the last window is what was left of the time budget; 4.5x to 9.8x a window measured, under
    # load too; a window where the machine slowed the fast one alone still holds 2x
    windows = [e["replica_steps"] for e in syncs[:-1]]
    assert all(fast >= 2 * slow for fast, slow in windows), windows
    assert sum(fast for fast, _ in windows) >= 3 * sum(slow for _, slow in windows), windows
    assert syncs[-1]["replica_steps"][0] >= syncs[-1]["replica_steps"][1]
    steps = {r: max(e["step"] for e in read_events(run, ("step",)) if e["rank"] == r) for r in (0, 1)}
    assert steps[0] >= 3 * steps[1]  # each replica's own step count is in its events
    assert syncs[-1]["total_steps"] == steps[0] + steps[1]
    ends = [e for e in read_events(run, ("run",)) if e["phase"] == "end"]
    assert len(ends) == 2 and (run.root / "summary.json").exists()


@pytest.mark.parametrize("reference", [False, True])
def test_aedit_step_budget(train_run, reference):
    """reference: atorch's penalty and its minimum of new steps, with windows far too short to
    hold 60 steps, so most syncs are called off; the budget still holds."""
    extra = (["--edit-penalty", "reference", "--aedit-min-new-steps", 60, "--sync-seconds", 0.02]
             if reference else ["--sync-seconds", 0.3])
    run = train_run("--algo", "aedit", "--model", "nano", "--replicas", 2, "--shards", 1,
                    "--steps", 60, "--warmup-sync-steps", 3, "--batch-size", BATCH,
                    "--seq-len", SEQ, "--eval-every", 0, "--link-bandwidth", "none", *extra)
    last = sync_events(run)[-1]
    steps = {r: max(e["step"] for e in read_events(run, ("step",)) if e["rank"] == r) for r in (0, 1)}
    assert last["total_steps"] == steps[0] + steps[1]
    # the run ends at the first sync with R x --steps = 120 steps done; the last window is cut
    # to the steps remaining at the previous window's rate, so it ends close to that
    assert 120 <= last["total_steps"] <= 144
    if reference:
        roots = [e for e in sync_events(run) if e["block"] == "root"]
        assert all(sum(e["replica_steps"]) >= 60 for e in roots[:-1]), roots
        assert sum(e["skipped"] for e in roots) > 0 and len(roots) <= 2
        assert all("per_step_norm" not in e for e in roots)  # raw norms



@pytest.mark.slow
def test_aedit_budget_holds_and_the_summary_tells_the_steps_run(train_run):
    """The issue's case: a 2 x 30 budget with a 1 s window once ran 91 steps while summary.json
    said 30. The budget now holds within one step per replica, and the summary tells each
    replica's steps and their mean."""
    for steps, window, straggler in ((30, 1.0, "1:1"), (100, 0.3, "1:3")):
        run = train_run("--algo", "aedit", "--model", "nano", "--replicas", 2, "--steps", steps,
                        "--sync-seconds", window, "--warmup-sync-steps", 2, "--straggler",
                        straggler, "--batch-size", BATCH, "--seq-len", SEQ, "--eval-every", 0,
                        "--link-bandwidth", "none", name=f"run-{steps}")
        ran = [max(e["step"] for e in read_events(run, ("step",)) if e["rank"] == r) for r in (0, 1)]
        assert 2 * steps <= sum(ran) <= 2 * steps + 2, ran
        summary = run.read_json(run.summary)
        assert summary["steps"] == steps and summary["steps_run_per_replica"] == ran
        assert summary["steps_run"] == sum(ran) / 2
    assert ran[0] > ran[1], ran  # the straggler's windows held fewer of its steps
    # the step events tell the lr used, the schedule at the run's global progress: the slow
    # replica's last step came when the run was further on than the fast one's same step number
    lrs = {r: {e["step"]: e["lr"] for e in read_events(run, ("step",)) if e["rank"] == r}
           for r in (0, 1)}
    assert lrs[1][ran[1]] < lrs[0][ran[1]], (lrs[1][ran[1]], lrs[0][ran[1]])
