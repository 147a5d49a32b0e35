"""The simulator against lowband's own runs: a run's measured CU beside the plan's (how close they
are is a benchmark's claim, benchmarks/plan_accuracy.py: 18 runs, within 10 points), and every
planned transfer the bytes the run's telemetry recorded."""

import json
import re
from collections import Counter

import pytest

from lowband.plan import check_run, exchange_phases, plan_config, predict_to_target, run_of
from lowband.plan.api import config_of
from lowband.report import write_report
from lowband.telemetry import read_events

pytestmark = pytest.mark.slow  # measured (--durations): README, Run the tests


def test_a_run_is_checked_against_its_plan_and_drawn_on_it(train_run, tmp_path):
    run = train_run("--algo", "streaming", "--sync-every", 8, "--fragments", 2, "--model", "micro",
                    "--steps", 16, "--link-bandwidth", "100Mbit", "--link-latency", "0ms",
                    "--eval-every", 0, name="streaming")
    result = check_run(run.root)
    assert 0 < result["predicted_cu"] <= 1 and 0 < result["measured_cu"] <= 1, result
    # its predicted time to a loss reached after N tokens: N x its figure's factor / tokens/s
    summary = run.read_json(run.summary)
    to = predict_to_target(run.root, summary["tokens"])
    assert to["tokens_factor"] > 1 and "Charles" in to["fit"]
    assert to["seconds"] == summary["tokens"] * to["tokens_factor"] / to["tokens_per_s"] > 0

    # the report draws the plan's curves with the run as a measured point
    page = write_report([run.root], tmp_path / "report.html").read_text()
    assert 'id="plan-section"' in page
    data = json.loads(re.search(r'Plotly.newPlot\(\s*"lowband-plan",\s*(\[.*?\]),\s*\{', page, re.S).group(1))
    assert [d["name"] for d in data if "measured" in d["name"]] == [
        "streaming measured (streaming, 100 Mbit/s)"]
    planned = next(d for d in data if d["name"] == "streaming planned (streaming, 100 Mbit/s)")
    assert planned["y"] == [result["predicted_cu"]]


def test_planned_transfers_are_the_bytes_sent(train_run):
    # nano with 4 blocks in 4 fragments, each synced once (H=4): fragment 0 holds the embeddings;
    # 3 replicas, where an all-gather sends 2x the payload and a two-phase exchange 4/3x
    run = train_run("--algo", "streaming", "--model", "nano", "--n-layer", 4, "--seq-len", 32,
                    "--batch-size", 2, "--fragments", 4, "--sync-every", 4, "--overlap", 0,
                    "--codec", "fp4-e3m0", "--replicas", 3, "--steps", 4,
                    "--eval-every", 0, "--link-bandwidth", "none")
    sent, calls = Counter(), Counter()  # rank 0's outer collectives, per fragment
    guard = []  # the guard's norms beside each exchange: 32 bytes to each of the 2 others, which
    for e in read_events(run, ("comm",)):  # the planner leaves out (algorithms/guard.py)
        if e["rank"] == 0 and e["group"] == "outer" and e["tag"].endswith("-norm"):
            guard.append(e["wire_bytes"])
        elif e["rank"] == 0 and e["group"] == "outer":
            sent[e["tag"]] += e["wire_bytes"]
            calls[e["tag"]] += 1
    assert guard == [2 * 32] * 4
    config = run.read_json(run.config)
    cfg, params = {k: v for k, v in config.items() if k != "meta"}, config["meta"]["n_params"]
    plan = run_of(config_of(cfg), 0.01, params=params)
    phases = {f"frag{p}": exchange_phases(plan, n)
              for p, n in enumerate(plan.fragment_sizes)}
    assert sent == {tag: sum(w) for tag, w in phases.items()}
    assert calls == {tag: len(w) for tag, w in phases.items()}
    assert plan.fragment_sizes[0] > 1.2 * plan.params / 4
    peak = max(e["wire_bytes"] for e in read_events(run, ("comm",)) if e["group"] == "outer")
    assert plan_config(cfg, step_time=0.01, params=params)["peak_transfer_bytes"] == peak == max(phases["frag0"])


def test_plan_of_a_finished_run_reads_and_simulates_it_once(train_run, monkeypatch):
    import lowband.plan.check as check
    import lowband.plan.cli as cli

    run = train_run("--algo", "diloco", "--sync-every", 2, "--model", "nano", "--n-layer", 2,
                    "--seq-len", 16, "--batch-size", 2, "--steps", 6, "--eval-every", 0,
                    "--link-bandwidth", "50Mbit", "--link-latency", "0ms")
    calls = Counter()

    def counted(name, f):
        def wrapped(*a, **k):
            calls[name] += 1
            return f(*a, **k)
        return wrapped

    monkeypatch.setattr(cli, "measured", counted("measured", cli.measured))
    monkeypatch.setattr(check, "measured", counted("measured", check.measured))
    monkeypatch.setattr(check, "plan_config", counted("plan_config", check.plan_config))
    out, _ = cli.run_plan(["--config", str(run.root), "--compare", "none"])
    assert calls == {"measured": 1}  # its events read once, its own row planned once
    assert out["measured"]["predicted_cu"] == out["algorithms"]["diloco"]["cu"]
    assert out["measured"] == check_run(run.root)  # what checking it alone says
    # planned otherwise than it ran (another step time): check_run plans the run as it ran
    calls.clear()
    other, _ = cli.run_plan(["--config", str(run.root), "--compare", "none", "--step-time", "1"])
    assert calls == {"measured": 1, "plan_config": 1}
    assert other["algorithms"]["diloco"]["inputs"]["step_time"] == 1
    assert other["measured"] == out["measured"]
