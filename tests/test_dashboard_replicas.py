"""Each replica's work (dashboard/replicas.py): a straggler's fast replica waits under fixed
steps (synthetic runs); a real run with adaptive local steps reads the same steps and tokens as
its summary.json and step events; the dashboard and the report show the same table."""

import json
import re

import pytest

from conftest import lowband
from lowband.dashboard.model import RunModel
from lowband.dashboard.replicas import replicas_table, setup_text, straggler_factors
from lowband.dashboard.style import fmt_value
from lowband.telemetry import RunDir, read_events
from lowband.testing.synthetic import make_run


def test_a_fast_replica_waits_for_its_straggler(tmp_path):
    """Replica 1 computes 2x slower: replica 0 computes 40% of each step and waits the rest
    (synthetic.py), replica 1 80%; each replica's tokens are its two ranks'."""
    run = make_run(tmp_path / "s", steps=60, straggler={1: 2})
    fast, slow = RunModel(run.root).load().replica_work()
    assert (fast.replica, fast.ranks, fast.steps, slow.steps) == (0, 2, 60, 60)
    assert fast.tokens == slow.tokens == 2 * 60 * 4096
    assert (fast.straggler, slow.straggler) == (1.0, 2.0)
    assert fast.utilization == pytest.approx(0.4, rel=1e-3)
    assert slow.utilization == pytest.approx(0.8, rel=1e-3)
    assert fast.wait_s == pytest.approx(60 * 0.06) and slow.wait_s == pytest.approx(60 * 0.02)
    assert fast.period_steps is None and slow.period_steps is None  # fixed steps: no column
    table = replicas_table([RunModel(run.root).load()])
    assert table.count("<tr>") == 3 and "steps a period" not in table
    assert all(f"<td>{fmt_value('compute_utilization', r.utilization)} " in table
               for r in (fast, slow))
    assert "<td>1×</td>" in table and "<td>2×</td>" in table


def test_the_dashboard_and_the_report_show_the_same_table(tmp_path):
    """Several runs: a run's name on its first row; a run of one replica alone shows none."""
    pytest.importorskip("ipywidgets")
    from lowband.dashboard import Dashboard
    from lowband.report import render_report

    a = make_run(tmp_path / "a", steps=40, straggler={1: 3}).root
    b = make_run(tmp_path / "b", steps=40, replicas=3, shards=1).root
    d = Dashboard([a, b])
    models = [RunModel(a).load(), RunModel(b).load()]
    assert d.replicas.value == replicas_table(models)
    assert d.replicas.value.count("<tr>") == 1 + 2 + 3
    assert d.replicas.value.count("<b>a</b>") == 1 and "<b>b</b>" in d.replicas.value
    page = render_report([a, b])
    assert 'id="replicas"' in page and replicas_table(models) in page
    data = json.loads(re.search(r'id="lowband-report-data">(.*?)</script>', page,
                                re.S).group(1).replace("<\\/", "</"))
    assert [r["straggler"] for r in data["runs"][0]["replicas"]] == [1.0, 3.0]
    assert data["runs"][0]["replicas"][1]["utilization"] == \
        models[0].replica_work()[1].utilization == pytest.approx(0.8, rel=2e-3)
    alone = make_run(tmp_path / "one", steps=20, replicas=1).root
    assert replicas_table([RunModel(alone).load()]) == ""
    assert 'id="replicas"' not in render_report(alone)


def test_straggler_factors_and_the_setup_in_words():
    assert straggler_factors({"straggler": "0:1,1:2,2:4"}, 3) == {0: 1, 1: 2, 2: 4}
    assert straggler_factors({"straggler": "5:2"}, 2) == {}   # refused by the trainer: none
    assert straggler_factors({}, 2) == {}
    assert setup_text({"straggler": "1:2", "local_steps": "adaptive"}) == \
        "--straggler 1:2 --local-steps adaptive"
    assert setup_text({"straggler": "", "local_steps": "fixed"}) == ""
    assert setup_text({"slowdown": "1:3:5:10", "pause": "0:4:2", "local_steps": "fixed"}) == \
        "--slowdown 1:3:5:10 --pause 0:4:2"


def test_adaptive_steps_read_as_the_summary_and_the_events_say(tmp_path):
    """A real run, replica 1 a 2x straggler under --local-steps adaptive: the table's steps are
    summary.json's steps_run_per_replica, its tokens each replica's first rank's last step
    event's, its steps a period each replica's latest sync event's local_steps; the report
    the run wrote shows them."""
    proc = lowband("train", "--algo", "streaming", "--local-steps", "adaptive", "--straggler",
                   "1:2", "--steps", "40", "--eval-every", "20", "--model", "nano",
                   "--no-progress", "--run-dir", tmp_path / "run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = RunDir(tmp_path / "run")
    summary = run.read_json(run.summary)
    rows = RunModel(run.root).load().replica_work()
    assert [r.steps for r in rows] == summary["steps_run_per_replica"]
    assert rows[0].steps > rows[1].steps       # the fast replica ran more steps
    shards = summary["shards"]
    last = {}
    for e in read_events(run, ("step", "sync")):
        last[(e["kind"], e["rank"])] = e
    assert [r.tokens for r in rows] == [last[("step", r.replica * shards)]["tokens"]
                                        for r in rows]
    assert sum(r.tokens for r in rows) == summary["tokens"]
    assert [r.period_steps for r in rows] == [last[("sync", r.replica * shards)]["local_steps"]
                                              for r in rows]
    assert [r.straggler for r in rows] == [1.0, 2.0]
    assert all(0 < r.utilization <= 1 for r in rows)
    page = (run.root / "report.html").read_text(encoding="utf-8")
    section = page[page.index('id="replicas"'):page.index("</section>", page.index(
        'id="replicas"'))]
    assert "steps a period" in section
    for r in rows:
        assert f"<td>{r.steps:,}</td>" in section and f"<td>{r.period_steps:,}</td>" in section
