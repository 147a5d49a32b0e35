"""What reaching a loss took: summary.json's `target` (--target-loss) from a run whose losses
are known. (The eval events' own fields on a real run: test_cli.py's main job; their clock
across a resume: test_resume.py.)"""

import json
import math
import re
from types import SimpleNamespace

import pytest

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


def test_a_synthetic_runs_target_agrees_with_its_events_and_the_report(tmp_path):
    from lowband.report import write_report
    from lowband.telemetry import read_events
    from lowband.testing.synthetic import make_run

    # validation loss 1.65 + 3 exp(-s / 60) at steps 49, 99, 149, 199: 2.98, 2.23, 1.90, 1.76
    runs = [make_run(tmp_path / name, name=name, steps=200, target_loss=loss).root
            for name, loss in (("fast", 2.0), ("never", 1.0))]
    fast = json.loads((runs[0] / "summary.json").read_text())["target"]
    assert (fast["reached"], fast["step"], fast["tokens"]) == (True, 149, 4 * 150 * 4096)
    assert fast["elapsed_s"] == pytest.approx(15.0, abs=0.01)
    (ev,) = [e for e in read_events(runs[0], ("eval",)) if e["step"] == 149]
    assert {k: ev[k] for k in ("elapsed_s", "tokens", "outer_bytes")} == \
        {k: fast[k] for k in ("elapsed_s", "tokens", "outer_bytes")}
    never = json.loads((runs[1] / "summary.json").read_text())["target"]
    assert not never["reached"] and never["best_step"] == 199
    assert never["best_val_loss"] == pytest.approx(1.65 + 3 * math.exp(-199 / 60))
    old = make_run(tmp_path / "old", name="old", steps=200).root     # no target: an older run
    text = write_report([*runs, old], tmp_path / "r.html").read_text(encoding="utf-8")
    row = re.search(r"<th>time to target</th>(.*?)</tr>", text).group(1)
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
    assert cells == ["15.0 s", f"not reached (best {never['best_val_loss']:.4f})", "–"]


def test_the_live_dashboard_offers_the_axes_and_opens_mixed_algorithms_on_time(tmp_path):
    from lowband.dashboard import Dashboard
    from lowband.dashboard.style import XAXES
    from lowband.testing.synthetic import make_run

    a = make_run(tmp_path / "a", name="a", steps=60)
    b = make_run(tmp_path / "b", name="b", algo="diloco", fragments=1, steps=60)
    d = Dashboard([a.root, b.root])
    assert [v for _, v in d.xaxis.options] == ["step", "tokens", "time", "bytes"]
    assert d.xaxis.value == "time" and d.loss_fig.layout.xaxis.title.text == XAXES["time"]
    d.xaxis.value = "bytes"
    summary = json.loads((a.root / "summary.json").read_text())
    (line,) = [t for t in d.loss_fig.data if t.name == "a · replica 0"]
    assert line.x[-1] == pytest.approx(summary["outer_wire_bytes"], rel=0.05)
    assert Dashboard(a.root).xaxis.value == "step"                 # one algorithm: steps
    assert Dashboard([a.root, b.root], xaxis="tokens").xaxis.value == "tokens"  # asked for


def test_runs_written_before_these_fields_still_draw(tmp_path):
    from lowband.dashboard import figures as F
    from lowband.dashboard.model import RunModel
    from lowband.testing.synthetic import make_run

    rd = make_run(tmp_path / "old", steps=60)
    for path in rd.events.glob("rank*.jsonl"):   # as an older trainer wrote them
        events = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({k: v for k, v in e.items() if k not in
                                            ("elapsed_s", "tokens", "outer_bytes")
                                            or e["kind"] == "step" and k == "tokens"}) + "\n"
                                for e in events))
    m = RunModel(rd.root).load()
    xs = {ax: {t["name"]: t["x"] for t in F.loss_spec([m], ax)[0]} for ax in F.XAXES}
    # seconds since the first event, tokens estimated from the steps, bytes from comm events
    assert xs["time"]["replica 0"][-1] == pytest.approx(m.replicas[0].t[-1] - m.t0)
    assert xs["time"]["val loss"] == [pytest.approx(t - m.t0) for t in m.val_series()[2]]
    assert xs["tokens"]["val loss"] == [50 * 4096 * 4]             # the evaluation at step 49
    assert 0 < xs["bytes"]["val loss"][0] < xs["bytes"]["replica 0"][-1] <= m.outer_wire_bytes
