"""--time-budget: runs end at a wall-clock training time, every rank at the same step, with a
final evaluation and checkpoint; the learning rate fits the budget; a resume keeps the time
spent; bad input is refused in one sentence."""

import math

import pytest

from conftest import train_in_one_job
from lowband.checkpoint import read_rank_state
from lowband.config import Config, ConfigError
from lowband.schedule import lr_at
from lowband.telemetry import RunDir, read_events

pytestmark = pytest.mark.slow  # measured (--durations): README, Run the tests

TINY = ["--model", "micro", "--seq-len", "32", "--batch-size", "4", "--eval-batches", "1",
        "--steps", "100000", "--warmup-steps", "2", "--no-progress", "--link-bandwidth", "none"]


def test_schedule_fits_the_budget():
    """Warm-up by steps, the peak held, a cosine to the floor over the budget's last fifth, at
    the later of the time's and the steps' progress; without a budget the cosine over --steps."""
    lr, floor = 1e-3, 1e-4
    cfg = Config(lr=lr, min_lr_ratio=0.1, warmup_steps=4, steps=1000, time_budget=60.0)
    mid = floor + (lr - floor) / 2  # halfway through the decay
    assert lr_at(cfg, 0, 0.0) == pytest.approx(lr / 4)  # warming up
    assert lr_at(cfg, 1, 0.5) == pytest.approx(lr / 2)
    assert lr_at(cfg, 10, 0.0) == lr_at(cfg, 10, 0.79) == pytest.approx(lr)  # stable
    assert lr_at(cfg, 10, 0.9) == pytest.approx(mid)
    assert lr_at(cfg, 10, 1.0) == lr_at(cfg, 10, 1.2) == pytest.approx(floor)
    assert lr_at(cfg, 900, 0.1) == pytest.approx(mid)  # --steps ends it first: decays by steps
    assert lr_at(cfg, 0, 0.9) == pytest.approx(mid / 4)  # a budget spent during the warm-up
    cfg.time_budget = None  # the step schedule, whatever the clock says
    for step in (0, 3, 4, 500, 999):
        want = lr * (step + 1) / 4 if step < 4 else \
            floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * (step - 4) / 996))
        assert lr_at(cfg, step, 0.95) == lr_at(cfg, step) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("value", [-1.0, 0.0, float("nan"), float("inf")])
def test_bad_budget_is_refused_in_one_sentence(tmp_path, lowband_here, value):
    code, stderr = lowband_here("train", "--time-budget", value, "--run-dir", tmp_path / "r",
                                cwd=tmp_path)
    assert code == 2 and stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert f"--time-budget must be a positive, finite number of seconds, got {value}" in stderr
    assert not (tmp_path / "r").exists() and not (tmp_path / "runs").exists()


def test_budget_with_elastic_and_old_configs():
    with pytest.raises(ConfigError, match="--time-budget needs one clock for the whole job"):
        Config(algo="diloco", time_budget=5.0, elastic=True).validate()
    # aedit's former --max-seconds, in a config written before it became --time-budget
    assert Config.from_dict({"algo": "aedit", "max_seconds": 30}).validate().time_budget == 30.0
    assert Config.from_dict({"algo": "aedit", "max_seconds": 0.0}).validate().time_budget is None


def _steps(run: RunDir, rank: int = 0) -> list[dict]:
    return [e for e in read_events(run.root, ("step",)) if e["rank"] == rank]


def _within_one_evaluation(run: RunDir, budget: float, eval_every: int) -> None:
    """summary.json's wall_s lies within an evaluation interval (its last eval_every steps'
    time) of the budget, and the final evaluation is at the last step."""
    summary = run.read_json(run.summary)
    interval = max(sum(e["step_s"] for e in _steps(run, r)[-eval_every:]) for r in (0, 1))
    assert abs(summary["wall_s"] - budget) <= interval, (summary["wall_s"], interval)
    evals = [e for e in read_events(run.root, ("eval",)) if e["rank"] == 0]
    assert evals[-1]["step"] == _steps(run)[-1]["step"] and math.isfinite(evals[-1]["val_loss"])
    assert summary["final_val_loss"] == pytest.approx(evals[-1]["val_loss"])


BUDGET, EVERY = 3.0, 4  # (the last step within 1-2% of it: its lr near the end of the decay)
TIMED = ["--time-budget", BUDGET, "--eval-every", EVERY, *TINY]


def test_a_budgeted_run_ends_on_time_and_its_resume_keeps_the_time_spent(tmp_path):
    """ddp stopped after 8 steps (as if interrupted) and resumed in processes of their own:
    the resumed attempt trains only what is left of the budget and ends within an evaluation
    of it, with a final evaluation and checkpoint, both ranks at the same step with the same
    learning rates (one clock), held at the peak and then decayed."""
    ddp = RunDir(tmp_path / "ddp")
    train_in_one_job(["--algo", "ddp", *TIMED, "--checkpoint-every", EVERY, "--stop-after", 8,
                      "--run-dir", ddp.root])
    spent = read_rank_state(ddp.root / "checkpoints" / "step-00000008", 0)["progress"]["wall_s"]
    assert 0 < spent < BUDGET / 2
    train_in_one_job(["--resume", ddp.root])  # (its flags are read from the run it continues)
    steps = _steps(ddp)
    resumed = sum(e["step_s"] for e in steps if e["step"] > 8)
    assert resumed < BUDGET - spent + sum(e["step_s"] for e in steps[-EVERY:])
    _within_one_evaluation(ddp, BUDGET, EVERY)
    last = steps[-1]["step"]
    assert last > 8 and _steps(ddp, 1)[-1]["step"] == last
    assert (ddp.root / "checkpoints" / f"step-{last:08d}").is_dir()  # the final checkpoint
    lrs = [e["lr"] for e in steps]
    assert lrs == [e["lr"] for e in _steps(ddp, 1)]
    assert max(lrs) == pytest.approx(3e-3) and lrs[-1] < 0.4 * max(lrs)


def test_acco_and_aedit_end_on_time(tmp_path):
    """acco owns its step (its micro-batch budget from --steps is only an upper bound); aedit
    keeps the budget itself and ends at the first sync past it."""
    train_in_one_job(["--algo", "acco", *TIMED, "--run-dir", tmp_path / "acco"],
                     ["--algo", "aedit", "--sync-seconds", 0.5, "--warmup-sync-steps", 2,
                      *TIMED, "--run-dir", tmp_path / "aedit"])
    _within_one_evaluation(RunDir(tmp_path / "acco"), BUDGET, EVERY)
    aedit = RunDir(tmp_path / "aedit")  # past the budget by at most a step and the sync
    assert BUDGET <= aedit.read_json(aedit.summary)["wall_s"] <= BUDGET + 1.0
    for rank in (0, 1):  # each replica's final evaluation at its own last step
        evals = [e for e in read_events(aedit.root, ("eval",)) if e["rank"] == rank]
        assert evals[-1]["step"] == _steps(aedit, rank)[-1]["step"]
