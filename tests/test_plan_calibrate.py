"""`lowband plan --calibrate DIR`: the tokens factors a finished `lowband compare` measured take
the published figures' place for the settings it compared. The comparison directory is written
by hand as compare/runner.py writes it (compare.json's table, a config.json per run), so no run
trains here."""

import json
import re

import pytest

from lowband.cli import main as lowband
from lowband.plan import PlanError, main, plan_configs
from lowband.plan.api import config_of
from lowband.plan.cli import _parser

PARAMS = 836_736  # the micro model's parameters, as the trainer records them (meta.n_params)
LINK = dict(model="micro", link_bandwidth="100Mbit", link_latency="10ms", steps=200)
MAIN = LINK | dict(algo="streaming", sync_every=20, fragments=4, overlap=1, codec="fp4-e3m0")
DDP_TOKENS = 100_000


def _row(name: str, algo: str, tokens) -> dict:
    target = ({"loss": 3.0, "reached": True, "step": 10, "val_loss": 2.99, "elapsed_s": 5.0,
               "tokens": tokens, "outer_bytes": 1}
              if tokens else {"loss": 3.0, "reached": False, "best_val_loss": 3.2,
                              "best_step": 10, "evaluations": 3})
    return {"name": name, "algorithm": algo, "run_dir": f"elsewhere/{name}",
            "given": {"steps": 200}, "target": target}


def comparison(root, runs: dict, reference="ddp", finished=True):
    """A comparison directory: runs maps a name to (its config's options, tokens to the target
    or None: not reached)."""
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, (options, tokens) in runs.items():
        (root / name).mkdir()
        cfg = config_of(options).to_dict() | {"meta": {"n_params": PARAMS, "world": 2}}
        (root / name / "config.json").write_text(json.dumps(cfg))
        rows.append(_row(name, options["algo"], tokens))
    table = {"dir": str(root), "equal": "time", "reference": reference, "target_loss": 3.0,
             "target_from": f"{reference}'s final validation loss", "budget_s": 5.0,
             "equal_time_s": 5.0, "runs": rows}
    (root / "compare.json").write_text(json.dumps(
        {"identity": {"runs": list(runs)}} | (table if finished else {})))
    return root


@pytest.fixture
def compared(tmp_path):
    return comparison(tmp_path / "cmp", {
        "ddp": (LINK | {"algo": "ddp"}, DDP_TOKENS),
        "streaming": (MAIN, 1.4 * DDP_TOKENS),                       # the config's own setting
        "diloco": (LINK | {"algo": "diloco", "sync_every": 50}, 1.2 * DDP_TOKENS),  # another H
        "edit": (LINK | {"algo": "edit", "sync_every": 20}, 1.3 * DDP_TOKENS),
        "acco": (LINK | {"algo": "acco"}, None)})                   # never reached the target


def test_a_compared_setting_takes_its_measured_factor(compared):
    figures = plan_configs(MAIN, step_time=0.03)["algorithms"]
    out = plan_configs(MAIN, step_time=0.03, calibration=compared)
    rows, ddp = out["algorithms"], out["algorithms"]["ddp"]
    s = rows["streaming"]
    assert s["loss_penalty"]["tokens_factor"] == pytest.approx(1.4)
    assert s["loss_penalty"]["fit"] == f"measured by lowband compare, {compared}, run streaming"
    assert s["time_to_ddp_loss_s"] == pytest.approx(
        ddp["wall_s"] * 1.4 * ddp["tokens_per_s"] / s["tokens_per_s"])
    assert s["time_to_ddp_loss_s"] != pytest.approx(figures["streaming"]["time_to_ddp_loss_s"])
    # diloco was compared at another H: its row keeps the published figure
    assert rows["diloco"]["loss_penalty"] == figures["diloco"]["loss_penalty"]
    assert "lowband compare" not in rows["diloco"]["loss_penalty"]["fit"]
    # edit has no published figure: calibrated, it gets a time to ddp's loss
    assert figures["edit"]["time_to_ddp_loss_s"] is None
    e = rows["edit"]
    assert e["time_to_ddp_loss_s"] == pytest.approx(
        ddp["wall_s"] * 1.3 * ddp["tokens_per_s"] / e["tokens_per_s"])
    # acco's run did not reach the target: no factor, and the plan says so
    assert rows["acco"]["time_to_ddp_loss_s"] is None
    assert ddp["vs_ddp"] == 1 and rows["zero1"] == figures["zero1"]
    assert out["calibration"] == {
        "dir": str(compared), "reference": "ddp", "not_reached": {"acco": "acco"},
        "calibrated": {"streaming": {"run": "streaming", "tokens_factor": pytest.approx(1.4)},
                       "edit": {"run": "edit", "tokens_factor": pytest.approx(1.3)}}}


def test_another_model_size_matches_nothing(compared):
    out = plan_configs(MAIN, step_time=0.03, params=2e6, calibration=compared)
    assert out["calibration"]["calibrated"] == {} == out["calibration"]["not_reached"]
    assert "lowband compare" not in out["algorithms"]["streaming"]["loss_penalty"]["fit"]


def test_the_command_line_says_which_rows_were_calibrated(compared, capsys):
    assert main(["--recipe", "main", "--step-time", "30ms", "--compare", "diloco,edit,acco",
                 "--calibrate", str(compared)]) == 0
    out = capsys.readouterr().out
    assert f"calibrated by lowband compare ({compared}, against ddp)" in out
    assert "streaming (run streaming: 1.4x ddp's tokens)" in out and "edit (run edit: 1.3x" in out
    assert f"acco: not reached in {compared} (its setting's run acco): no measured factor" in out
    # diloco's row still rests on the figures (lowband's own, plan/measured.py, for this size)
    assert "the loss from lowband's own measurement" in " ".join(out.split())
    edit = next(line for line in out.splitlines() if line.startswith("edit "))
    assert "no figure" not in edit and edit.rstrip().endswith("s)")
    assert "--calibrate DIR" in _parser().format_help()


@pytest.mark.parametrize("case, says", [
    ("missing", "is not a lowband compare directory (no compare.json)"),
    ("unfinished", "holds no table (the comparison did not finish)"),
    ("not ddp", "was measured against diloco (diloco), not ddp"),
    ("ddp short", "its ddp reference did not reach"),
])
def test_a_directory_that_cannot_calibrate_is_refused_in_one_sentence(tmp_path, capsys, case, says):
    runs = {"ddp": (LINK | {"algo": "ddp"}, None if case == "ddp short" else DDP_TOKENS),
            "diloco": (LINK | {"algo": "diloco"}, DDP_TOKENS)}
    root = tmp_path / "cmp"
    if case != "missing":
        comparison(root, runs, "diloco" if case == "not ddp" else "ddp",
                   finished=case != "unfinished")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(PlanError, match=re.escape(says)):
        plan_configs(MAIN, step_time=0.03, calibration=root)
    assert lowband(["plan", "--recipe", "main", "--step-time", "30ms", "--calibrate",
                    str(root)]) == 2
    err = capsys.readouterr()
    assert err.out == "" and err.err.count("\n") == 1 and says in err.err
    assert err.err.startswith(f"lowband: error: --calibrate {root} ")
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written
