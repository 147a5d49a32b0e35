"""The terminal's comparison from compare.json-like records, without training: it names the target
above the table, fits 100 columns (two tables where one would not), and ends with one line saying
which run reached the target soonest, or that two did within one evaluation (a tie)."""

import pytest

from lowband.compare.table import WIDTH, eval_interval, target_answer, text
from lowband.summary import target


def _run(name, algorithm, elapsed=None, interval=2.0, heterogeneity="", best=2.61):
    """A row as lowband.compare.table.rows writes it; elapsed None: the target not reached."""
    reached = {"loss": 2.52, "reached": True, "step": 100, "val_loss": 2.519,
               "elapsed_s": elapsed, "tokens": 409_600, "outer_bytes": 3_350_000}
    if elapsed is None:
        reached = {"loss": 2.52, "reached": False, "best_val_loss": best, "best_step": 200}
    return {"name": name, "algorithm": algorithm, "target": reached,
            "target_eval_interval_s": interval if elapsed is not None else None,
            "planned_time_to_target_s": 18.0, "planned_error": -0.1,
            "val_loss_at_equal_time": best, "compute_utilization": 0.912,
            "planned_compute_utilization": 0.95, "tokens_per_s": 20_400.0,
            "final_val_loss": best, "wall_s": 38.2, "heterogeneity": heterogeneity,
            "lowest_replica_compute_utilization": 0.4, "lowest_replica": 0}


def _result(*runs):
    return {"runs": list(runs), "reference": "ddp", "target_loss": 2.52,
            "target_from": "ddp's final validation loss", "equal": "time", "equal_time_s": 38.2}


def test_the_table_names_the_target_fits_100_columns_and_answers():
    result = _result(_run("ddp", "ddp", 38.2), _run("streaming", "streaming", 20.1),
                     _run("sweep-3-of-a-long-name-for-diloco", "diloco", 29.0),
                     _run("aedit", "aedit", None))
    lines = text(result).splitlines()
    assert lines[0] == ("target: validation loss 2.5200 (ddp's final); equal time: 38.2 s of "
                        "training, the shortest run's")
    assert lines[-1] == "streaming reached 2.5200 in 20.1 s, 1.9x sooner than ddp (38.2 s)."
    assert max(map(len, lines)) <= WIDTH
    body = "\n".join(lines)
    assert "not reached" in body and "20.1 s" in body and "91.2 %" in body
    assert "sweep-3-of-a-long-name-…" in body  # a name cut at 24 characters
    assert "algorithm" in body  # a name that does not say its algorithm: the column is there


def test_uneven_replicas_wrap_into_a_second_table():
    slow = "--straggler 1:2 --local-steps adaptive --slowdown 1:3:10"
    result = _result(_run("ddp", "ddp", 38.2, heterogeneity="--straggler 1:2"),
                     _run("streaming", "streaming", 20.1, heterogeneity=slow))
    lines = text(result).splitlines()
    assert max(map(len, lines)) <= WIDTH
    rows = [ln for ln in lines[:-1] if ln.startswith("streaming ")]
    assert len(rows) == 2  # its line in each table
    assert "20.1 s" in rows[0] and slow in rows[1] and "40.0 % (replica 0)" in rows[1]
    assert "algorithm" not in "\n".join(lines)  # every name says its algorithm


@pytest.mark.parametrize("runs, said", [
    # 0.9 s apart, and the slower evaluated every 2 s there: a tie, not a win
    ([("ddp", 38.2, 2.0), ("streaming", 20.1, 2.0), ("diloco", 21.0, 2.0)],
     "streaming and diloco reached 2.5200 within one evaluation (20.1 s, 21.0 s), "
     "1.9x sooner than ddp (38.2 s)."),
    # the same times, evaluated every 0.5 s: a win
    ([("ddp", 38.2, 2.0), ("streaming", 20.1, 2.0), ("diloco", 21.0, 0.5)],
     "streaming reached 2.5200 in 20.1 s, 1.9x sooner than ddp (38.2 s)."),
    # the reference soonest: against the next
    ([("ddp", 20.0, 2.0), ("streaming", 30.0, 2.0)],
     "ddp reached 2.5200 in 20.0 s, 1.5x sooner than streaming (30.0 s)."),
    ([("ddp", 20.0, 2.0), ("streaming", 21.0, 2.0)],
     "ddp and streaming reached 2.5200 within one evaluation (20.0 s, 21.0 s)."),
    ([("ddp", None, None), ("streaming", 20.1, 2.0)],
     "streaming reached 2.5200 in 20.1 s; the other runs did not reach it."),
    ([("ddp", None, None), ("streaming", None, None)],
     "no run reached 2.5200; the lowest validation loss at equal time: ddp's 2.6100."),
])
def test_the_answer_says_a_tie_within_one_evaluation(runs, said):
    result = _result(*(_run(name, name, t, interval) for name, t, interval in runs))
    assert target_answer(result) == said
    assert " ".join(text(result).split("\n\n")[-1].splitlines()) == said  # wrapped if long


def test_the_evaluation_interval_is_the_gap_before_the_reaching_evaluation():
    evals = [[10, 3.0, 4.0, 1, 1], [20, 2.6, 8.5, 2, 2], [30, 2.5, 12.0, 3, 3]]
    assert eval_interval(evals, target(evals, 2.55)) == pytest.approx(3.5)
    assert eval_interval(evals, target(evals, 3.0)) == pytest.approx(4.0)  # from the start
    assert eval_interval(evals, target(evals, 1.0)) is None
