"""lowband.report: the offline HTML report and its command line."""

import html
import json
import re

import pytest

from lowband.dashboard import figures as F
from lowband.dashboard.model import RunModel
from lowband.testing.synthetic import make_run
from lowband.report import ReportError, main, write_report
from lowband.telemetry import read_events


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    a = make_run(root / "a", name="streaming-fp4", steps=100, fragments=2,
                 spike={"replica": 0, "step": 70, "size": 1.5})
    b = make_run(root / "b", name="diloco-fp32", algo="diloco", steps=80, fragments=1,
                 finished=False)
    return a.root, b.root


def report_data(text: str) -> dict:
    m = re.search(r'<script type="application/json" id="lowband-report-data">(.*?)</script>',
                  text, re.S)
    assert m, "the report's data block is missing"
    return json.loads(m.group(1).replace("<\\/", "</"))


def test_report_of_one_run_is_self_contained(runs, tmp_path):
    out = write_report(runs[0], tmp_path / "one.html")
    text = out.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>")
    assert "streaming-fp4" in text
    # offline: plotly.js inline, nothing loaded from elsewhere
    assert not re.search(r"<script[^>]*\bsrc\s*=", text, re.I)
    assert not re.search(r"<link[^>]*\bhref\s*=\s*[\"']?(https?:)?//", text, re.I)
    assert len(text) > 1_000_000 and "Plotly.newPlot" in text
    for div in ("lowband-loss", "lowband-bandwidth", "lowband-timeline-0"):
        assert f'id="{div}"' in text
    data = report_data(text)
    (run,) = data["runs"]
    assert run["name"] == "streaming-fp4" and run["finished"]
    assert run["stats"]["spikes"] == 1
    assert run["config"]["algo"] == "streaming"


def test_report_on_two_runs_overlays_and_compares(runs, tmp_path):
    out = write_report(list(runs), tmp_path / "two.html", title="fp4 vs fp32")
    text = out.read_text(encoding="utf-8")
    data = report_data(text)
    assert [r["name"] for r in data["runs"]] == ["streaming-fp4", "diloco-fp32"]
    assert data["title"] == "fp4 vs fp32"
    assert not data["runs"][1]["finished"]
    assert "no summary.json yet" in data["runs"][1]["stats"]["status"]
    assert 'id="lowband-timeline-1"' in text
    assert 'class="ratio"' in text                # side-by-side numbers relative to the first
    assert 'class="diff"' in text                 # config rows that differ are marked
    # the overlay: both runs' curves in one loss figure (the report's builder)
    models = [RunModel(r).load() for r in runs]
    names = {t.name for t in F.loss_figure_static(models).data}
    assert {"streaming-fp4 · replica 0", "diloco-fp32 · replica 1"} <= names
    assert "streaming-fp4 (mean per link)" in {t.name for t in
                                               F.make_figure(F.bandwidth_spec(models)).data}


def test_loss_figure_buttons_switch_the_x_axis(runs):
    m = RunModel(runs[0]).load()
    fig = F.loss_figure_static([m])
    menu = fig.layout.updatemenus[0]
    assert [b.label for b in menu.buttons] == ["step", "tokens", "wall time", "outer bytes"]
    assert menu.active == 0 and fig.data[0].x[-1] == 99   # one algorithm: it opens on steps
    xs = {b.label: b.args[0]["x"] for b in menu.buttons}
    assert all(len(x) == len(fig.data) for x in xs.values())
    assert xs["tokens"][0][-1] == 100 * 4096 * 4          # tokens of the whole run at the last step
    # the run's training seconds and outer bytes: the curves end at the summary's totals, and
    # the validation points lie where the eval events say (the same run-wide numbers)
    val = [t.name for t in fig.data].index("val loss")
    assert xs["wall time"][0][-1] == pytest.approx(100 * 0.1 + 0.002, abs=1e-6)
    assert xs["outer bytes"][0][-1] == pytest.approx(m.summary["outer_wire_bytes"])
    evals = [e for e in read_events(runs[0], ("eval",))]
    assert list(xs["wall time"][val]) == [e["elapsed_s"] for e in evals]
    assert list(xs["outer bytes"][val]) == [e["outer_bytes"] for e in evals]
    assert list(xs["tokens"][val]) == [e["tokens"] for e in evals]


def test_a_comparison_of_algorithms_opens_on_wall_clock_time(runs, tmp_path):
    models = [RunModel(r).load() for r in runs]           # streaming and diloco
    fig = F.loss_figure_static(models)
    menu = fig.layout.updatemenus[0]
    assert menu.buttons[menu.active].label == "wall time"
    assert fig.layout.xaxis.title.text == F.XAXES["time"]
    assert list(fig.data[0].x) == list(menu.buttons[menu.active].args[0]["x"][0])
    assert fig.data[0].x[-1] == pytest.approx(100 * 0.1 + 0.002, abs=1e-6)
    html = write_report(list(runs), tmp_path / "mixed.html").read_text(encoding="utf-8")
    assert '"active":2' in html.replace(" ", "")


def test_report_lists_membership_changes_and_restarts(runs, tmp_path):
    el = make_run(tmp_path / "el", name="elastic", replicas=3, shards=2, steps=100,
                  elastic={"kill": 1, "at": 40, "back": 80, "heal_bytes": 1.2e6, "heal_s": 0.3})
    text = write_report(el.root, tmp_path / "el.html").read_text(encoding="utf-8")
    section = re.search(r'<section id="membership">(.*?)</section>', text, re.S).group(1)
    rows = re.findall(r"<tr[^>]*>(<td>.*?)</tr>", section)
    assert len(rows) == 3 + 2 + 3                    # one per replica group and quorum
    cells = [re.findall(r"<td>(.*?)</td>", r) for r in rows]
    assert [c[:4] for c in cells[3:5]] == [["40", "4.00 s", "0", "group 1 left"],
                                            ["40", "4.01 s", "2", "group 1 left"]]
    healed = cells[6]
    assert healed[2:5] == ["1", "group 1 rejoined (healed 2.4 MB in 0.3 s)", "2 (3 groups)"]
    assert healed[6:8] == ["2.4 MB", "0.3 s"]
    assert "restarts: group 1: 1; groups finished: 0, 1, 2." in section
    assert 'id="failed-commits"' not in text and "uncommitted" not in text   # no failed vote
    assert 'data-key="elastic.restarts">group 1: 1<' in text
    assert 'data-key="elastic.groups_finished">0, 1, 2<' in text
    assert "dashed purple lines" in text
    (run,) = report_data(text)["runs"]
    assert run["stats"]["elastic"] == {"groups_finished": [0, 1, 2], "restarts": {"1": 1}}
    assert [r["change"] for r in run["membership"]][3:5] == ["group 1 left"] * 2
    fig = F.loss_figure_static([RunModel(el.root).load()])
    assert {"membership change", "membership label"} <= {t.name for t in fig.data}
    assert len(fig.layout.updatemenus[0].buttons[1].args[0]["x"]) == len(fig.data)
    # a run without membership events: no section, no rows, no traces, no data
    plain = write_report(runs[0], tmp_path / "plain.html").read_text(encoding="utf-8")
    assert 'id="membership"' not in plain and "elastic." not in plain
    assert "membership" not in json.dumps(report_data(plain))
    assert not any("membership" in t.name
                   for t in F.loss_figure_static([RunModel(runs[0]).load()]).data)


def test_report_lists_failed_commit_votes(runs, tmp_path):
    # group 1 of three is gone from step 40 to 80; the others' vote on step 50's sync fails
    el = make_run(tmp_path / "vote", name="vote", replicas=3, shards=2, steps=100,
                  elastic={"kill": 1, "at": 40, "back": 80, "uncommitted": 50})
    text = write_report(el.root, tmp_path / "vote.html").read_text(encoding="utf-8")
    section = re.search(r'<section id="membership">(.*?)</section>', text, re.S).group(1)
    assert "restarts: group 1: 1; groups finished: 0, 1, 2; uncommitted syncs: 1 (commit vote " \
           "failed, outer update skipped)." in section
    commits = re.search(r'id="failed-commits".*?<table class="grid commits">(.*?)</table>',
                        section, re.S).group(1)
    rows = re.findall(r"<tr>(<td>.*?)</tr>", commits)
    assert [re.findall(r"<td>(.*?)</td>", r) for r in rows] == [
        ["50", "5.20 s", "1", "groups 0, 2", "0, 1, 4, 5"]]    # the time: when the vote came
    assert len(re.findall(r'<tr[^>]*>(<td>.*?)</tr>', section)) == 3 + 2 + 3 + 1
    assert "dotted orange lines" in text and "crossed-out orange diamond" in text
    (run,) = report_data(text)["runs"]
    assert [(c["step"], c["fragment"], c["replicas"]) for c in run["failed_commits"]] == [
        (50, 1, [0, 2])]
    # the figures the report embeds carry the marks, on every x axis of the loss figure
    m = RunModel(el.root).load()
    fig = F.loss_figure_static([m])
    mark = next(t for t in fig.data if t.name == "failed commit mark")
    assert mark.text == ("commit vote failed in groups 0, 2: outer update of fragment 1 "
                         "skipped there (step 50)",)
    assert len(fig.layout.updatemenus[0].buttons[1].args[0]["x"]) == len(fig.data)
    assert "commit vote failed in groups 0, 2: outer update of fragment 1 skipped there " \
           "(step 50)" in text
    # a run without a failed vote: none of it in its report
    plain = write_report(runs[0], tmp_path / "plain.html").read_text(encoding="utf-8")
    assert "failed_commits" not in json.dumps(report_data(plain))
    assert "commit vote failed" not in plain and 'id="failed-commits"' not in plain


def test_report_lists_restarts(runs, tmp_path):
    rq = make_run(tmp_path / "rq", name="requeued", steps=40,
                  restart={"at": 20, "crash": 27, "slurm_restart": 1})
    text = write_report(rq.root, tmp_path / "rq.html").read_text(encoding="utf-8")
    section = re.search(r'<section id="restarts">(.*?)</section>', text, re.S).group(1)
    rows = re.findall(r"<tr>(<td>.*?)</tr>", section)
    assert [re.findall(r"<td>(.*?)</td>", r) for r in rows] == [
        ["20", "7.80 s", "1", "21–27", "1"]]     # step, time, attempt, lost steps, requeue
    hover = "attempt 1 resumed from step 20 (steps 21–27 of the lost attempt redone; Slurm " \
            "requeue 1)"
    assert json.dumps(hover)[1:-1] in text       # the figures' hover text (JSON, \u2013)
    assert "dash-dot teal lines" in text and "teal triangle" in text
    (run,) = report_data(text)["runs"]
    assert [(r["attempt"], r["step"], r["superseded_to"], r["slurm_restart"])
            for r in run["restarts"]] == [(1, 20, 27, 1)]
    # a run that never restarted: none of it in its report
    plain = write_report(runs[0], tmp_path / "plain.html").read_text(encoding="utf-8")
    assert 'id="restarts"' not in plain and "resumed from step" not in plain
    assert "teal lines" not in plain and "restarts" not in report_data(plain)["runs"][0]


def test_write_report_refuses_what_is_not_a_run(tmp_path, runs):
    with pytest.raises(ReportError, match="not a lowband run directory"):
        write_report([tmp_path], tmp_path / "x.html")
    with pytest.raises(ReportError, match="does not exist"):
        write_report([tmp_path / "missing"], tmp_path / "x.html")
    with pytest.raises(ReportError, match="at least one"):
        write_report([], tmp_path / "x.html")
    with pytest.raises(ReportError, match="does not exist"):
        write_report(runs[0], tmp_path / "no" / "such" / "x.html")


def test_main_writes_a_report(runs, tmp_path, capsys):
    out = tmp_path / "cli.html"
    assert main([str(runs[0]), str(runs[1]), "-o", str(out)]) == 0
    assert out.is_file() and "diloco-fp32" in out.read_text(encoding="utf-8")


@pytest.mark.parametrize("argv", [
    ["{tmp}", "-o", "{tmp}/r.html"],                 # a directory that is not a run
    ["{tmp}/missing", "-o", "{tmp}/r.html"],         # one that does not exist
    ["{run}", "-o", "{tmp}/missing/r.html"],         # an output folder that does not exist
    [],                                              # no run at all
])
def test_main_bad_input_is_one_sentence_and_exit_2(argv, runs, tmp_path, capsys):
    argv = [a.format(tmp=tmp_path, run=runs[0]) for a in argv]
    from lowband.cli import main as lowband

    assert lowband(["report", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip() and err.strip().splitlines()[-1].startswith("lowband: error: ")


def test_report_data_is_strict_json_when_values_are_nan(runs, tmp_path):
    import shutil

    run = tmp_path / "nan-run"
    shutil.copytree(runs[0], run)
    summary = json.loads((run / "summary.json").read_text())
    summary["final_val_loss"] = float("nan")
    (run / "summary.json").write_text(json.dumps(summary))     # json writes NaN
    text = write_report(run, tmp_path / "nan.html").read_text(encoding="utf-8")
    block = re.search(r'id="lowband-report-data">(.*?)</script>', text, re.S).group(1)
    json.loads(block, parse_constant=lambda c: pytest.fail(f"{c} in the report's JSON"))


def _section(text: str, section: str) -> str:
    m = re.search(rf'<section id="{section}">(.*?)</section>', text, re.S)
    assert m, f"the report has no #{section}"
    return m.group(1)


def _with(run, tmp_path, name: str, summary: dict | None = None, config: dict | None = None):
    """A copy of a synthetic run with these summary fields added and this config.json."""
    import shutil

    copy = tmp_path / name
    shutil.copytree(run, copy)
    s = json.loads((copy / "summary.json").read_text())
    (copy / "summary.json").write_text(json.dumps({**s, **(summary or {})}))
    if config is not None:
        (copy / "config.json").write_text(json.dumps(config))
    return copy


def test_every_summary_row_has_a_label(runs, tmp_path):
    from lowband.dashboard.tables import LABELS, SUMMARY_COLUMNS

    run = _with(runs[0], tmp_path, "labelled", {
        "steps_run": 100, "steps_run_per_replica": [100, 100], "ddp_outer_wire_bytes": 4e9,
        "setup_wire_bytes": 0, "run_dir": "runs/x", "my_own_field": 3})
    table = _section(write_report(run, tmp_path / "r.html").read_text(encoding="utf-8"),
                     "summary")
    labels = re.findall(r"<tr><th>(.*?)</th>", table)
    assert labels and not [t for t in labels if "_" in t]      # no raw keys
    for key in ("compute_s", "ddp_outer_wire_bytes", "steps_run_per_replica", "steps_run"):
        assert LABELS[key] in labels
    assert "my own field" in labels                              # a key without a label
    assert '<td data-key="steps_run_per_replica">100, 100</td>' in table
    # the dashboard's summary panel takes its labels from the same table
    assert all(label == LABELS[key] for key, label in SUMMARY_COLUMNS)


def test_the_report_opens_with_the_headline_lowband_train_prints(runs, tmp_path):
    from lowband.summary import comparison

    run = _with(runs[0], tmp_path, "headline", {"ddp_outer_wire_bytes": 4e9, "steps_run": 100})
    text = write_report(run, tmp_path / "r.html").read_text(encoding="utf-8")
    summary = json.loads((run / "summary.json").read_text())
    line = comparison(summary, "20Mbit")                  # the synthetic run's link
    assert "x what streaming sent" in line and "s a step of sending alone" in line
    assert _section(text, "headline") == f"<p>{html.escape(line)}.</p>"
    assert text.index('id="headline"') < text.index('id="summary"')
    ddp = _with(runs[0], tmp_path, "ddp", {"algorithm": "ddp", "ddp_outer_wire_bytes": 4e9},
                config={"algo": "ddp"})
    assert 'id="headline"' not in write_report(ddp, tmp_path / "d.html").read_text("utf-8")


def test_the_config_shows_the_options_the_run_reads(runs, tmp_path):
    from lowband.algorithms import ALGORITHMS
    from lowband.config import Config

    config = Config(algo="streaming").to_dict()
    config["warmup_sync_steps"] = 5                       # an edit option, changed
    config["meta"] = {"n_params": 123}
    run = _with(runs[0], tmp_path, "config", config=config)
    section = _section(write_report(run, tmp_path / "r.html").read_text("utf-8"), "config")
    shown, folded = section.split("<details>")
    keys = lambda part: set(re.findall(r"<tr><th>([^<]+)</th>", part))  # noqa: E731
    streaming = {n for g in ALGORITHMS["streaming"].options for n in g.names()}
    assert streaming <= keys(shown) and {"lr", "model", "link_bandwidth"} <= keys(shown)
    assert "warmup_sync_steps" in keys(shown) and "meta.n_params" in keys(shown)
    assert "edit_anomaly" in keys(folded) and "acco_micro" in keys(folded)
    assert keys(shown) | keys(folded) == set(config) - {"meta"} | {"meta.n_params"}
    assert re.search(r"<summary>\d+ options of other algorithms, at their defaults</summary>",
                     folded)
    assert '<tr class="group"><th colspan="2">fragments</th></tr>' in shown


def test_the_spike_count_names_the_detectors_warm_up(runs, tmp_path):
    text = write_report(runs[0], tmp_path / "r.html").read_text(encoding="utf-8")
    cell = re.search(r'<td data-key="spikes">(.*?)</td>', _section(text, "summary")).group(1)
    assert cell.startswith("1 ") and "warm-up" in cell and "first 20 steps" in cell
    assert "grey band" in _section(text, "loss-section")
    m = RunModel(runs[0]).load()
    band = next(t for t in F.loss_figure_static([m]).data if t.name == "spike detector warm-up")
    assert (min(band.x), max(band.x)) == (0, 19) and band.yaxis == "y2"   # steps 0 to 19
