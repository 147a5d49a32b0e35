"""`lowband compare`: two tiny runs (ddp, then streaming given ddp's training time) on an
emulated link write the table and the report; ddp reaches its own final loss by construction;
a comparison that stopped continues without redoing its finished runs; bad input is refused in
one sentence with nothing written."""

import json
import shutil

import pytest

from conftest import lowband
from lowband.compare import STEPS_CAP, evaluations, loss_at
from lowband.compare.table import target_answer
from lowband.summary import target
from lowband.telemetry import RunDir, read_events

pytestmark = pytest.mark.slow  # measured (--durations): README, Run the tests

TINY = ["--model", "nano", "--steps", "12", "--seq-len", "32", "--batch-size", "4",
        "--eval-batches", "1", "--eval-every", "4", "--link-bandwidth", "100Mbit",
        "--link-latency", "0ms", "--sync-every", "4", "--fragments", "2", "--checkpoint-every", "4", "--no-progress"]


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """`lowband compare --algos ddp,streaming` run once for this module's tests."""
    where = tmp_path_factory.mktemp("compare")
    proc = lowband("compare", "--algos", "ddp,streaming", "--dir", "cmp", "--", *TINY, cwd=where)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return where / "cmp", proc.stdout


def test_the_table_and_the_report(compared):
    root, stdout = compared
    result = json.loads((root / "compare.json").read_text())
    ddp, streaming = result["runs"]
    assert (ddp["name"], streaming["name"], result["reference"]) == ("ddp", "streaming", "ddp")
    summary = {r["name"]: RunDir(root / r["name"]).read_json(RunDir(root / r["name"]).summary)
               for r in (ddp, streaming)}
    # ddp ran its --steps; streaming got ddp's training seconds, --steps raised out of the way
    assert summary["ddp"]["steps_run"] == 12 and "time_budget" not in ddp["given"]
    assert streaming["given"] == {"steps": STEPS_CAP, "time_budget": summary["ddp"]["wall_s"]}
    assert json.loads((root / "streaming" / "config.json").read_text())["time_budget"] == \
        summary["ddp"]["wall_s"]
    # the target is ddp's final validation loss, which ddp reaches at its last evaluation
    assert result["target_loss"] == summary["ddp"]["final_val_loss"]
    t = ddp["target"]
    assert t["reached"] and t["step"] == 12 and t["tokens"] == summary["ddp"]["tokens"]
    assert t["elapsed_s"] == pytest.approx(summary["ddp"]["wall_s"])
    assert t["outer_bytes"] == summary["ddp"]["outer_wire_bytes"]
    # equal time: the shorter run's end, where its loss is its final one
    assert result["equal_time_s"] == pytest.approx(min(s["wall_s"] for s in summary.values()))
    short = min(summary, key=lambda n: summary[n]["wall_s"])
    assert {r["name"]: r for r in result["runs"]}[short]["val_loss_at_equal_time"] == \
        pytest.approx(summary[short]["final_val_loss"])
    assert ddp["planned_time_to_target_s"] > 0 and ddp["planned_fit"]  # the plan's beside it
    assert ddp["planned_error"] == pytest.approx(
        ddp["planned_time_to_target_s"] / ddp["target"]["elapsed_s"] - 1)  # and its miss
    for row in result["runs"]:  # measured and planned compute utilization, tokens/s
        assert 0 < row["compute_utilization"] <= 1 and 0 < row["planned_compute_utilization"] <= 1
        assert row["tokens_per_s"] == summary[row["name"]]["tokens_per_s"]
        assert row["heterogeneity"] == "" and 0 < row["lowest_replica_compute_utilization"] <= 1
    assert streaming["outer_wire_bytes"] < ddp["outer_wire_bytes"]
    # printed, and the report opens with the same table
    assert stdout.count("target: validation loss ") == 1 and "time to" in stdout
    printed = stdout[stdout.index("target: "):stdout.index(target_answer(result))]
    assert max(map(len, printed.splitlines())) <= 100 and "ddp " in printed
    assert all(r["target_eval_interval_s"] > 0 for r in result["runs"] if r["target"]["reached"])
    assert "note: --fragments is not an option of --algo ddp" in stdout
    html = (root / "report.html").read_text(encoding="utf-8")
    assert html.index('id="compare"') < html.index('id="summary"')
    assert html.count('<td data-key="target.elapsed_s">') == 2


def test_a_stopped_comparison_continues_without_redoing_finished_runs(compared, tmp_path):
    """streaming as if its processes died after its first checkpoint: calling again resumes it
    from there, and ddp (finished) is not run again."""
    import lowband

    root = shutil.copytree(compared[0], tmp_path / "cmp")
    streaming = RunDir(root / "streaming")
    ddp_events = RunDir(root / "ddp").event_file(0).read_bytes()
    for name in ("summary.json", "model.pt", "outer.pt"):
        (streaming.root / name).unlink(missing_ok=True)
    first, *later = sorted((streaming.root / "checkpoints").glob("step-*"))
    for path in later:
        shutil.rmtree(path)
    result = lowband.compare(algos=["ddp", "streaming"], flags=TINY, directory=root,
                             report=False)
    assert RunDir(root / "ddp").event_file(0).read_bytes() == ddp_events
    phases = [e["phase"] for e in read_events(streaming, ("run",)) if e["rank"] == 0]
    assert phases == ["start", "resume", "end"], phases
    assert streaming.read_json(streaming.summary) is not None
    assert [r["name"] for r in result["runs"]] == ["ddp", "streaming"]


def test_evaluations_read_as_the_trainer_keeps_them(tmp_path):
    """A run's eval events give back the records summary.json's target read, and the loss at a
    time lies on the line between two evaluations."""
    from lowband.testing.synthetic import make_run

    run = make_run(tmp_path / "r", steps=200, target_loss=2.0)
    evals = evaluations(run.root)
    assert target(evals, 2.0) == run.read_json(run.summary)["target"]
    (s0, v0, t0, *_), (s1, v1, t1, *_) = evals[:2]
    assert loss_at(evals, (t0 + t1) / 2) == pytest.approx((v0 + v1) / 2)
    assert loss_at(evals, t0 / 2) is None and loss_at(evals, 1e9) == evals[-1][1]
    assert loss_at([], 1.0) is None


def test_the_table_shows_each_runs_heterogeneity_and_its_least_busy_replica(tmp_path):
    """Runs read without training: a run whose replica 1 is a 2x straggler under fixed steps
    names its set-up, and its fast replica 0, waiting at every sync, is the least busy; the
    terminal's table and the report's section say the same."""
    from lowband.compare.table import rows, text
    from lowband.dashboard.comparison import compare_section
    from lowband.dashboard.model import RunModel
    from lowband.testing.synthetic import make_run

    plain = make_run(tmp_path / "plain", steps=40).root
    slow = make_run(tmp_path / "slow", steps=40, straggler={1: 2}).root
    table, _ = rows([("plain", str(plain), {"steps": 40}), ("slow", str(slow), {"steps": 40})],
                    2.5, "plain")
    alike, uneven = table
    assert (alike["heterogeneity"], uneven["heterogeneity"]) == ("", "--straggler 1:2")
    assert uneven["replica_compute_utilization"] == \
        [w.utilization for w in RunModel(slow).load().replica_work()]
    assert uneven["lowest_replica"] == 0
    assert uneven["lowest_replica_compute_utilization"] == pytest.approx(0.4, rel=2e-3)
    assert uneven["lowest_replica_compute_utilization"] < uneven["compute_utilization"]
    result = {"runs": table, "reference": "plain"}
    line = " ".join(ln for ln in text(result).splitlines() if ln.startswith("slow "))
    assert "--straggler 1:2" in line and "40.0 % (replica 0)" in line
    section = compare_section(result)
    assert '<td data-key="heterogeneity">--straggler 1:2</td>' in section
    assert '<td data-key="lowest_replica_compute_utilization">40.0 % (replica 0)</td>' in section


def _refused(lowband_here, tmp_path, *args, says):
    code, stderr = lowband_here("compare", *args, cwd=tmp_path)
    assert code == 2 and stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert says in stderr, stderr
    return stderr


@pytest.mark.parametrize("args, says", [
    (["--recipes", "nope", "--algos", "ddp"], "unknown recipe 'nope': use one of"),
    (["--algos", "ddp,nope"], "unknown algorithm 'nope': use one of"),
    (["--configs", "missing.toml"], "config file 'missing.toml' does not exist"),
    ([], "give the runs to compare"),
    (["--algos", "ddp", "--", "--algo", "streaming"], "--algo is not a flag for every compared"),
    (["--recipes", "ddp", "--", "--recipe", "main"], "--recipes ddp is a whole configuration"),
    (["--algos", "ddp", "--equal", "tokens", "--", "--time-budget", "5"],
     "--equal tokens ends every run by its tokens"),
    (["--algos", "ddp", "--", "--target-loss", "-1"], "--target-loss must be"),
    (["--algos", "ddp", "--", "--target-loss", "nan"], "--target-loss must be"),
    (["--algos", "ddp", "--", "--target-loss", "0"], "--target-loss must be a positive"),
    (["--algos", "ddp", "--test-hosts", "--", "--link-bandwidth", "none"],
     "--test-hosts shapes the hosts' link to the runs'"),
])
def test_bad_input_is_one_sentence_and_writes_nothing(lowband_here, tmp_path, args, says):
    _refused(lowband_here, tmp_path, "--dir", "cmp", *args, says=says)
    assert not (tmp_path / "cmp").exists() and not (tmp_path / "compare").exists()


def test_a_directory_holding_other_runs_is_refused(lowband_here, tmp_path):
    other = tmp_path / "cmp"
    other.mkdir()
    held = {"identity": {"entries": [["algo", "ddp", "ddp"], ["algo", "diloco", "diloco"]],
                         "equal": "time", "configs": {}}}
    (other / "compare.json").write_text(json.dumps(held))
    _refused(lowband_here, tmp_path, "--algos", "ddp,streaming", "--dir", "cmp", *TINY,
             says="cmp holds a comparison of ddp, diloco, not of ddp, streaming: give another "
                  "--dir, or the same runs and flags to continue it.")
    assert json.loads((other / "compare.json").read_text()) == held
    assert sorted(p.name for p in other.iterdir()) == ["compare.json"]
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    _refused(lowband_here, tmp_path, "--algos", "ddp", "--dir", "full", *TINY,
             says="full is not empty and holds no comparison")


def test_equal_tokens_scales_steps_by_the_tokens_a_step():
    from lowband.compare.entries import resolve
    from lowband.compare.runner import _budget

    ddp, big = resolve(configs=(), algos=["ddp", "streaming"],
                       args={"steps": 30, "model": "nano", "fragments": 2})
    big.config.batch_size = 16  # twice the tokens a step of ddp's 8
    assert _budget(ddp, ddp, None, "tokens") == {"steps": 30}
    assert _budget(big, ddp, None, "tokens") == {"steps": 15}
    assert _budget(ddp, ddp, None, "time") == {"steps": 30}
