"""What reaching a loss took: summary.json's `target` (--target-loss) from a run whose losses
are known. (The eval events' own fields on a real run: test_cli.py's main job; their clock
across a resume: test_resume.py.)"""

import math
from types import SimpleNamespace

from lowband.summary import one_line, summarize

# a run's evaluations as the trainer keeps them: [step, val_loss (mean over replicas),
# elapsed_s, tokens, outer_bytes], run-wide
EVALS = [[5, 4.8, 1.5, 10240, 4_000_000], [10, 3.9, 3.25, 20480, 8_000_000],
         [15, float("nan"), 4.0, 30720, 12_000_000], [20, 3.5, 6.5, 40960, 16_000_000]]


def _summary(target_loss, evals=EVALS):
    cfg = SimpleNamespace(algo="streaming", replicas=2, shards=1, steps=20, run_dir="r",
                          batch_size=8, seq_len=128, target_loss=target_loss)
    rank = {"tokens": 20480, "steps": 20, "wall_s": 6.5, "compute_s": 6.0, "loss": 3.4,
            "val_loss": 3.5, "shard": 0, "outer_wire": 8_000_000, "inner_wire": 0,
            "peak_outer": 100}
    return summarize(cfg, [{**rank, "evals": evals}, {**rank, "evals": []}])


def test_target_reached_at_the_first_evaluation_at_or_below_it():
    s = _summary(3.9)
    assert s["target"] == {"loss": 3.9, "reached": True, "step": 10, "val_loss": 3.9,
                           "elapsed_s": 3.25, "tokens": 20480, "outer_bytes": 8_000_000}
    assert "target val loss 3.9 reached at step 10 after 3.2 s, 20.5 k tokens, 8 MB outer" \
        in one_line(s)
    assert _summary(100)["target"]["step"] == 5


def test_target_not_reached_says_the_best_loss():
    s = _summary(3.0)
    assert s["target"] == {"loss": 3.0, "reached": False, "best_val_loss": 3.5, "best_step": 20,
                           "evaluations": 4}
    assert one_line(s).endswith("; target val loss 3 not reached (best 3.5000)")
    none = _summary(3.0, evals=[[5, math.nan, 1.0, 1, 1]])["target"]
    assert none["best_val_loss"] is None and not none["reached"]


def test_no_target_no_field_and_old_summaries_read():
    s = _summary(0.0)
    assert "target" not in s and "target" not in one_line(s)
    assert "target" not in one_line({"algorithm": "ddp"})  # a summary of an older run
