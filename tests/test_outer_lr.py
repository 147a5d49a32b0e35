"""--outer-lr's default: by the replicas R and H, as the DiLoCo scaling laws found (at H = 30
0.4/0.6/0.6/0.8 for R = 1/2/4/8, rising with H), resolved when a config is validated, so a
run's config.json records the value it used; an explicit --outer-lr wins."""

import json

import pytest

from lowband.algorithms.outer import OUTER_LR_BOUNDS, default_outer_lr
from lowband.config import Config
from lowband.flags import parse_train, train_parser
from lowband.telemetry import read_events

OUTER_ALGOS = ("diloco", "streaming", "edit", "aedit")


def test_the_default_meets_the_papers_anchors_at_h30_and_clamps_outside_them():
    assert [default_outer_lr(R, 30) for R in (1, 2, 4, 8)] == [0.4, 0.6, 0.6, 0.8]
    assert default_outer_lr(6, 30) == pytest.approx(0.717, abs=1e-3)  # half-way in log2 R
    assert default_outer_lr(16, 30) == default_outer_lr(64, 30) == 0.8
    assert [default_outer_lr(R, None) for R in (1, 2, 4, 8)] == [0.4, 0.6, 0.6, 0.8]


def test_the_default_rises_with_r_and_h_and_stays_in_the_swept_range():
    Hs = (1, 2, 5, 10, 20, 30, 60, 100, 300, 1000, 10**6)
    for H in Hs:
        by_r = [default_outer_lr(R, H) for R in range(1, 33)]
        assert by_r == sorted(by_r)
        assert default_outer_lr(8, H) > default_outer_lr(1, H) or default_outer_lr(1, H) == 1.0
    for R in (1, 2, 3, 4, 8):
        by_h = [default_outer_lr(R, H) for H in Hs]
        assert by_h == sorted(by_h) and by_h[-1] == OUTER_LR_BOUNDS[1]  # capped at 1
        rising = [a < b for a, b in zip(by_h, by_h[1:]) if OUTER_LR_BOUNDS[0] < b < OUTER_LR_BOUNDS[1]]
        assert rising and all(rising)
        assert default_outer_lr(R, 60) - default_outer_lr(R, 30) == pytest.approx(0.05, abs=1e-3)
    assert default_outer_lr(1, 1) == OUTER_LR_BOUNDS[0]  # floored at the swept range's bottom


@pytest.mark.parametrize("algo", OUTER_ALGOS)
def test_each_outer_algorithm_resolves_it_from_its_r_and_h(algo):
    cfg = Config(algo=algo, replicas=4, sync_every=12).validate()
    # aedit syncs by time: no H in steps, the H = 30 value
    assert cfg.outer_lr == default_outer_lr(4, None if algo == "aedit" else 12)
    assert Config(algo="ddp").validate().outer_lr is None  # not an option of ddp's


def test_an_explicit_outer_lr_wins_and_recipes_keep_theirs():
    cfg, _ = parse_train(["--algo", "streaming", "--replicas", "4", "--outer-lr", "0.9"])
    assert cfg.outer_lr == 0.9
    cfg, _ = parse_train(["--recipe", "diloco_paper", "--replicas", "8"])
    assert cfg.outer_lr == 0.7  # the recipe sets its paper's value
    cfg, _ = parse_train(["--recipe", "main", "--replicas", "4"])
    assert cfg.outer_lr == default_outer_lr(4, cfg.sync_every)


def test_help_says_how_the_default_is_chosen():
    text = " ".join(train_parser().format_help().split())
    assert "outer SGD learning rate (default: by --replicas and --sync-every" in text
    assert "docs/fidelity.md)" in text


def test_config_json_records_the_resolved_value(train_run):
    run = train_run("--algo", "diloco", "--model", "nano", "--n-layer", 1, "--replicas", 2,
                    "--steps", 4, "--sync-every", 2, "--batch-size", 2, "--seq-len", 32,
                    "--eval-every", 0, "--eval-batches", 1, "--link-bandwidth", "none")
    want = default_outer_lr(2, 2)
    assert json.loads(run.config.read_text())["outer_lr"] == want
    assert {e["outer_lr"] for e in read_events(run, ("sync",))} == {want}
    # repeated from its record, the run keeps the value (now explicit)
    assert Config.from_file(str(run.root)).validate().outer_lr == want
