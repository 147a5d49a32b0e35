"""The loss at equal tokens measured here (benchmarks/per_token.py) and the planner taking it
where it applies (plan/measured.py), the published figures elsewhere (plan/loss.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from lowband.plan import loss, measured
from lowband.plan.cli import main as plan_main

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import per_token  # noqa: E402

STAND_IN = {("streaming", "adamw", 2): ((100_000, 0.02, 1.2), (1_000_000, 0.01, 1.1)),
            ("streaming", "adamw", 4): ((100_000, 0.04, 1.4), (1_000_000, 0.02, 1.2))}


def test_measured_figures_apply_inside_what_was_measured(monkeypatch):
    monkeypatch.setattr(measured, "MEASURED", STAND_IN)
    flat = lambda h: 1.0  # noqa: E731  (no H shape)
    p, factor, what = measured.loss_and_factor("streaming", "adamw", 100_000, 2, 20, flat)
    assert p == pytest.approx(0.02) and factor == pytest.approx(1.2)
    assert "N 0.1M-1M, R 2-4, H 20" in what and "streaming against ddp, adamw inner" in what
    # halfway in log N and in log2 R: p and ln(factor) linear there
    p, factor, _ = measured.loss_and_factor("streaming", "adamw", math.sqrt(1e11), 2, 20, flat)
    assert p == pytest.approx(0.015) and factor == pytest.approx(math.sqrt(1.2 * 1.1))
    p, factor, _ = measured.loss_and_factor("streaming", "adamw", 100_000, 3, 20, flat)
    w = math.log2(1.5)
    assert p == pytest.approx(0.02 + 0.02 * w)
    assert factor == pytest.approx(math.exp((1 - w) * math.log(1.2) + w * math.log(1.4)))
    # H scales p by the published shape's excess at H over the one measured, and the factor
    # follows at the exponent measured: 1.2 = 1.02 ** e, so 1.04 ** e
    shape = lambda h: h / 20  # noqa: E731
    p, factor, _ = measured.loss_and_factor("streaming", "adamw", 100_000, 2, 40, shape)
    assert p == pytest.approx(0.04)
    assert factor == pytest.approx(1.04 ** (math.log(1.2) / math.log(1.02)))
    for args in [("streaming", "muon", 100_000, 2, 20), ("diloco", "adamw", 100_000, 2, 20),
                 ("streaming", "adamw", 5e6, 2, 20), ("streaming", "adamw", 5e4, 2, 20),
                 ("streaming", "adamw", 100_000, 8, 20), ("streaming", "adamw", 100_000, 1, 20),
                 ("streaming", "adamw", 100_000, 2, 50), ("streaming", "adamw", 100_000, 2, 5)]:
        assert measured.loss_and_factor(*args, flat) is None, args


def test_the_planner_names_the_figures_it_took(monkeypatch):
    monkeypatch.setattr(measured, "MEASURED", STAND_IN)
    here = loss.penalty("diloco", 300_000, 2, 20)
    assert here.fit.startswith("lowband's own measurement") and here.outside == ""
    # outside what was measured: the published figures, with their own range
    for args in [(550e6, 2, 30), (300_000, 2, 100), (300_000, 8, 20)]:
        p = loss.penalty("diloco", *args)
        assert p == loss.published(*args) and p.fit == loss.FIT, args
    assert loss.penalty("diloco", 300_000, 2, 20, "streaming", "muon") == \
        loss.published(300_000, 2, 20)
    assert loss.penalty("diloco", 300_000, 2, 20, "diloco") == loss.published(300_000, 2, 20)
    assert loss.penalty("ddp", 300_000, 2, 20).tokens_factor == 1


def test_the_plan_says_which_figures_it_took(monkeypatch, capsys):
    monkeypatch.setattr(measured, "MEASURED", STAND_IN)  # micro's 837k parameters inside
    assert plan_main(["--recipe", "main", "--step-time", "30ms", "--compare", "ddp",
                      "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["algorithms"]["streaming"]
    assert row["loss_penalty"]["fit"].startswith("lowband's own measurement")
    assert row["loss_penalty"]["tokens_factor"] == pytest.approx(
        measured.loss_and_factor("streaming", "adamw", 837_000, 2, 20, lambda h: 1)[1],
        rel=0.01)
    assert plan_main(["--recipe", "main", "--step-time", "30ms", "--compare", "ddp"]) == 0
    assert "the loss from lowband's own measurement (benchmarks/per_token.py" in \
        " ".join(capsys.readouterr().out.split())
    # a model larger than any measured: the published figures, named as such
    assert plan_main(["--recipe", "main", "--model", "small", "--step-time", "30ms",
                      "--compare", "ddp"]) == 0
    assert "Charles et al." in capsys.readouterr().out


def test_crossing_and_slope():
    # the loss falls from 2.0 at k=1 to 1.8 at k=2: 1.9 is crossed at sqrt-ish of the way
    k = per_token.crossing(1.9, [(1.0, 2.0), (2.0, 1.8)])
    assert 1 < k < 2 and k == pytest.approx(math.exp(math.log(2) * math.log(2 / 1.9)
                                                     / math.log(2 / 1.8)))
    assert per_token.crossing(2.1, [(1.0, 2.0), (2.0, 1.8)]) == 1.0  # reached at equal tokens
    assert per_token.crossing(1.7, [(1.0, 2.0), (2.0, 1.8)]) is None  # beyond the runs
    rows = [{"params": n, "factor": 2 * n ** -0.1} for n in (1e5, 1e6, 1e7)]
    assert per_token.slope(rows) == pytest.approx(-0.1)
    assert per_token.slope(rows[:1]) is None
    assert -0.05 < per_token.published_slope(2) < 0  # the published factor falls with N


@pytest.mark.slow
def test_the_benchmark_runs_and_prints_the_planners_table(tmp_path):
    out = subprocess.run(
        [sys.executable, "per_token.py", "--smoke", "--models", "nano", "--replicas", "2",
         "--variants", "today", "--direct", "--dir", str(tmp_path / "runs"), "--plan",
         "--json", str(tmp_path / "r.json"), "--svg", str(tmp_path / "f.svg")],
        cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    (r,) = rows
    assert r["model"] == "nano" and r["ddp_val"] > 0 and len(r["direct_points"]) >= 2
    assert r["estimate"] == pytest.approx((1 + r["loss"]) ** (1 / r["alpha"]))
    assert r["factor"] == r["direct"]
    if r["direct"] is not None:  # it lies between the runs that bracket ddp's loss
        assert r["direct_points"][0][0] <= r["direct"] <= r["direct_points"][-1][0]
        assert f"('streaming', 'adamw', 2): (\n        ({r['params']}, " in out.stdout
    assert "MEASURED = {" in out.stdout
    assert (tmp_path / "f.svg").read_text().startswith("<svg")
    # the rows of earlier calls printed together, without running
    both = subprocess.run([sys.executable, "per_token.py", "--from", str(tmp_path / "r.json"),
                           str(tmp_path / "r.json"), "--plan"], cwd=ROOT / "benchmarks",
                          capture_output=True, text=True, timeout=120)
    assert both.returncode == 0 and both.stdout.count("| nano |") == 1, both.stderr[-2000:]
    # a second call reuses every finished run: no training
    again = subprocess.run(
        [sys.executable, "per_token.py", "--smoke", "--models", "nano", "--replicas", "2",
         "--dir", str(tmp_path / "runs")], cwd=ROOT / "benchmarks", capture_output=True,
        text=True, timeout=120)
    assert again.returncode == 0 and " steps: val " not in again.stdout


def test_the_planners_table_is_the_benchmarks_recorded_runs():
    """plan/measured.py holds what benchmarks/per_token.py recorded, no more, no less."""
    rows = [r for f in sorted((ROOT / "benchmarks/results/per-token-2026-11-29").glob("*.json"))
            for r in json.loads(f.read_text())["rows"]]
    want: dict = {}
    algo = {"today": "streaming", "diloco": "diloco"}
    for r in sorted(rows, key=lambda r: r["params"]):
        if r["variant"] in algo and r.get("direct"):
            want.setdefault((algo[r["variant"]], r["optimizer"], r["replicas"]), []).append(
                (r["params"], round(r["loss"], 5), round(r["direct"], 4)))
    assert want and {k: list(v) for k, v in measured.MEASURED.items()} == want
    assert measured.H == per_token.H
    # the main job (micro, R=2, H=20, AdamW) plans with them
    points = measured.MEASURED["streaming", "adamw", 2]
    micro = next(n for n, _, _ in points if 8e5 < n < 9e5)
    p = loss.penalty("diloco", micro, 2, 20)
    assert p.fit.startswith("lowband's own measurement")
    assert p.tokens_factor == pytest.approx(dict((n, f) for n, _, f in points)[micro])
