"""Recipes (lowband.recipes) and the main job: each recipe is a full, validated Config, runs a
few steps through `lowband train --recipe NAME`, and `lowband train` alone runs the main job
and prints what ddp would have sent beside its own figures."""

import json

import pytest

from conftest import lowband, train_in_one_job
from lowband import recipes
from lowband.config import Config, ConfigError
from lowband.models import num_params
from lowband.models.gpt import MODELS


@pytest.mark.parametrize("name", recipes.RECIPES)
def test_recipe_is_a_validated_config(name):
    cfg = recipes.RECIPES[name]()
    assert isinstance(cfg, Config) and cfg.validate() is cfg
    assert getattr(recipes, name) is recipes.RECIPES[name]  # lowband.recipes.NAME()
    changed = recipes.RECIPES[name](seed=7)
    assert changed.seed == 7 and changed.algo == cfg.algo


def test_recipe_overrides_are_checked():
    with pytest.raises(ConfigError, match="unknown key 'stepz'"):
        recipes.main(stepz=3)
    with pytest.raises(ConfigError, match="unknown recipe 'nope'"):
        recipes.get("nope")


def few_steps(cfg: Config) -> list:
    """Flags that make a recipe's run a few steps long and keep its own algorithm settings."""
    steps = max(3, getattr(cfg, "warmup_sync_steps", 0) + 2)
    flags = ["--steps", steps, "--eval-every", 0, "--eval-batches", 1]
    if cfg.algo == "aedit":
        flags += ["--sync-seconds", 0.5, "--time-budget", 30]
    return flags


RUNNABLE = [n for n in recipes.RECIPES if n != "main"]  # main: test_main_job_shows_the_point


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory):
    """root/NAME: each recipe but main, a few steps, trained with `lowband train --recipe NAME`'s
    flags in one job a world size (conftest.train_in_one_job: the CLI's parser, then train)."""
    root = tmp_path_factory.mktemp("recipes")
    train_in_one_job(*[["--recipe", name, "--no-progress", "--run-dir", root / name,
                        *few_steps(recipes.RECIPES[name]())] for name in RUNNABLE])
    return root


@pytest.mark.parametrize("name", RUNNABLE)
@pytest.mark.slow
def test_recipe_runs(recipe_runs, name):
    cfg = recipes.RECIPES[name]()
    run = recipe_runs / name
    saved = json.loads((run / "config.json").read_text())
    assert saved["algo"] == cfg.algo and saved["model"] == cfg.model
    assert saved["sync_every"] == cfg.sync_every and saved["link_bandwidth"] == cfg.link_bandwidth
    assert json.loads((run / "summary.json").read_text())["algorithm"] == cfg.algo


def test_recipes_command_lists_them(tmp_path):
    proc = lowband("recipes", cwd=tmp_path)
    assert proc.returncode == 0
    assert [line.split()[0] for line in proc.stdout.splitlines()] == list(recipes.RECIPES)
    one = lowband("recipes", "main", cwd=tmp_path)
    assert "algo = 'streaming'" in one.stdout and "link_bandwidth = '100Mbit'" in one.stdout
    bad = lowband("train", "--recipe", "nope", cwd=tmp_path)
    assert bad.returncode == 2 and "unknown recipe 'nope'" in bad.stderr


@pytest.mark.slow
def test_main_job_shows_the_point(tmp_path):
    """`lowband train` alone: streaming over an emulated link, with ddp's computed bytes beside
    its own and a report to open."""
    proc = lowband("train", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    run = tmp_path / lines[0].split(": ", 1)[1]
    assert lines[0].startswith("run directory: runs/streaming-")
    assert "outer link" in lines[1] and "compute utilization" in lines[1]
    assert lines[2].startswith("ddp would have sent") and "computed from the parameter sizes" in lines[2]
    assert lines[3] == f"report: {run.relative_to(tmp_path) / 'report.html'}"
    assert (run / "report.html").stat().st_size > 10_000
    summary = json.loads((run / "summary.json").read_text())
    config = json.loads((run / "config.json").read_text())
    assert config["algo"] == "streaming" and config["link_bandwidth"] == "100Mbit"
    # ddp's bytes, computed: every step each of the R ranks sends 2(n-1)/n of 4 bytes a
    # parameter to the next replica (one bucket holds the whole 0.8M model)
    n = num_params(MODELS["micro"].network(seq_len=config["seq_len"]))
    assert summary["ddp_outer_wire_bytes"] == 2 * 200 * (2 * 1 * 4 * n // 2)
    assert summary["ddp_outer_wire_bytes"] > 50 * summary["outer_wire_bytes"]
