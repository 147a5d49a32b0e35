"""Options owned by their algorithms: the registry drives validation and the grouped --help; a
run's own config.json (or its directory) is a config; codecs and models have one source each."""

import json

import pytest

from conftest import lowband
from lowband.algorithms import ALGORITHMS, option_groups, users
from lowband.algorithms.base import EVERY_STEP, PERIODIC
from lowband.comm import CODEC_RECORDS, CODECS, encode, payload_bytes
from lowband.config import COMMON_GROUPS, GROUPS, Config, ConfigError, fields
from lowband.flags import train_parser
from lowband.models import num_params
from lowband.models.gpt import MODELS
from lowband.plan import inputs as plan_inputs


def test_every_field_belongs_to_exactly_one_group():
    owned = [name for g in GROUPS for name in g.names()]
    assert sorted(owned) == sorted(f.name for f in fields())
    assert len(owned) == len(set(owned))


def test_registry_declares_each_algorithm():
    for name, algo in ALGORITHMS.items():
        assert algo.name == name and algo.kind in (EVERY_STEP, PERIODIC) and algo.summary
        assert set(algo.defaults) <= {n for g in algo.options for n in g.names()}
    assert {n for n, a in ALGORITHMS.items() if a.kind == EVERY_STEP} == {"ddp", "zero1", "acco"}
    assert set(option_groups()) == set(GROUPS) - set(COMMON_GROUPS)


@pytest.mark.parametrize("group", option_groups(), ids=lambda g: g.__name__)
def test_an_option_of_another_algorithm_is_refused_or_noted(group):
    """Each group's first option, set on an algorithm that does not read it, is refused; a
    shared knob (--sync-every, --codec...) is instead ignored with a note, so one sweep can pass
    it to every algorithm."""
    outsider = next(n for n, a in ALGORITHMS.items() if group not in a.options)
    f = next(f for f in group.__dataclass_fields__.values() if f.name in group.names())
    value = {bool: not f.default, int: 3, float: 0.5, str: "x"}[f.metadata["type"]]
    if f.metadata["choices"]:
        value = next(c for c in f.metadata["choices"] if c != f.default)
    cfg = Config(algo=outsider, **{f.name: value})
    if group.shared_knob:
        assert cfg.validate().ignored() == [
            f"--{f.name.replace('_', '-')} is read only by --algo {' or '.join(users(group))}: "
            f"--algo {outsider} ignores it."]
        return
    with pytest.raises(ConfigError, match=f"applies only to --algo {' or '.join(users(group))}"):
        cfg.validate()


def test_a_sweep_passes_sync_every_to_every_algorithm(tmp_path):
    """A shared knob set for ddp: the run goes on and the CLI notes once that ddp ignores it."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "lowband.cli", "train", "--algo", "ddp",
                           "--model", "nano", "--steps", "2", "--eval-every", "0",
                           "--eval-batches", "1", "--no-progress", "--sync-every", "8",
                           "--link-bandwidth", "none",
                           "--run-dir", str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("--sync-every is read only by --algo diloco") == 1, proc.stderr


def test_help_groups_options_by_algorithm():
    text = train_parser().format_help()
    for group in option_groups():
        title = f"{group.title} options (--algo {', '.join(users(group))})"
        assert title in text
        section = text.split(title, 1)[1].split("\n\n", 1)[0]
        for name in group.names():
            assert "--" + name.replace("_", "-") in section
    assert "run options:" in text and "emulated outer link" in text
    model = text.split("model options:", 1)[1].split("\n\n", 1)[0]  # the sizes: a group of their own
    assert all(f in model for f in ("--model", "--n-layer", "--n-head", "--d-model", "--vocab-size"))


def test_a_run_config_json_and_its_directory_are_configs(tmp_path):
    run = tmp_path / "old"
    run.mkdir()
    cfg = Config(algo="streaming", model="nano", fragments=2, steps=7, run_dir=str(run)).validate()
    (run / "config.json").write_text(json.dumps({**cfg.to_dict(), "meta": {"world": 2}}))
    for source in (run / "config.json", run):
        again = Config.from_file(str(source)).validate()
        assert again.algo == "streaming" and again.fragments == 2 and again.steps == 7
        assert again.run_dir == ""  # a repeat gets its own directory
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="directory without a config.json"):
        Config.from_file(str(tmp_path / "empty"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Config.from_file(str(tmp_path / "bad.json"))


@pytest.mark.slow
def test_a_finished_run_repeats_from_its_record(tmp_path):
    first = lowband("train", "--algo", "diloco", "--model", "nano", "--steps", 4, "--sync-every", 2,
                    "--eval-every", 0, "--no-progress", "--link-bandwidth", "none", "--run-dir",
                    tmp_path / "a", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    again = lowband("train", "--config", tmp_path / "a", "--no-progress", "--run-dir",
                    tmp_path / "b", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in "ab")
    assert b["algorithm"] == "diloco" and b["final_loss"] == a["final_loss"]


def test_codec_records_are_the_one_source():
    import torch

    assert CODECS == tuple(CODEC_RECORDS)
    assert plan_inputs.CODECS == CODECS  # the planner counts payload_bytes, exactly
    x = torch.randn(1000)
    for name, codec in CODEC_RECORDS.items():
        n = encode(x, name, 64).numel()
        assert n == payload_bytes(name, 1000, 64) == codec.payload_bytes(1000, 64)
        assert abs(n / 1000 - codec.bytes_per_value(64)) < 0.01


def test_model_registry_counts_what_it_builds():
    for name, spec in MODELS.items():
        assert plan_inputs.MODELS[name] == (spec.param_count(), spec.n_layer)
        if name != "gpt2":  # building GPT-2 takes a second; its formula is the same
            assert spec.param_count(seq_len=64) == num_params(spec.network(seq_len=64))
    assert Config(model="nano", n_layer=5).n_blocks() == 5


def test_environment_variable_names_are_spelled_once():
    """Every LOWBAND_*/TORCHFT_* variable of the package is in lowband.options.ENV, and no module
    but options.py spells one in a string (docstrings, which document them, aside): readers and
    writers use its constants."""
    import ast
    import re
    from pathlib import Path

    from lowband import options

    root = Path(options.__file__).parent
    ours = re.compile(r"\b(?:LOWBAND|TORCHFT)_[A-Z0-9_]+")
    spelled, unknown = [], set()
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and n.body and isinstance(n.body[0], ast.Expr)
                and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Constant) or not isinstance(node.value, str):
                continue
            for name in ours.findall(node.value):
                if name not in options.ENV:
                    unknown.add(name)
                elif id(node) not in docs and path.name != "options.py":
                    spelled.append(f"{path.relative_to(root)}:{node.lineno} {name}")
    assert not spelled, f"use lowband.options' constants, not the names: {spelled}"
    # a heredoc's delimiter (launch/slurm.py) is a name of that shape, not a variable
    assert unknown <= {"LOWBAND_GROUP_SCRIPT"}, f"not in lowband.options.ENV: {sorted(unknown)}"
    assert all(meaning and "\n" not in meaning for meaning in options.ENV.values())


def test_one_set_of_what_a_resume_may_change(tmp_path):
    """--resume and a relaunch into the same --run-dir (--auto-resume) take the same options over
    the run's config.json (config.RESUME_MAY_CHANGE) and refuse any other with the same rule."""
    from lowband.checkpoint.lifecycle import relaunched
    from lowband.config import RESUME_MAY_CHANGE, RESUME_RULE
    from lowband.flags import parse_train

    run = tmp_path / "run"
    run.mkdir()
    saved = Config(model="nano", steps=8, algo="diloco").validate()
    (run / "config.json").write_text(json.dumps({**saved.to_dict(), "run_dir": str(run)}))
    changed = {"steps": 9, "stop_after": 3, "crash_checkpoint": 2, "progress": True,
               "auto_resume": True, "overwrite": True, "oversubscribe": True, "run_dir": str(run)}
    assert set(changed) == set(RESUME_MAY_CHANGE)
    flags = [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}")
             for k, v in changed.items() if k != "run_dir"]
    cfg, resume = parse_train(["--resume", str(run), *flags])
    assert resume and (cfg.steps, cfg.stop_after, cfg.lr) == (9, 3, saved.lr)
    with pytest.raises(ConfigError) as refused:
        parse_train(["--resume", str(run), "--lr", "0.1"])
    assert RESUME_RULE in str(refused.value) and "--lr cannot be given" in str(refused.value)

    again = Config.from_dict({**saved.to_dict(), **changed, "overwrite": False})
    assert relaunched(again) == "auto"
    older = {k: v for k, v in saved.to_dict().items() if k != "max_skips"}  # before an option
    (run / "config.json").write_text(json.dumps({**older, "run_dir": str(run)}))
    assert relaunched(again) == "auto"  # it ran at that option's default
    again.max_skips += 1
    with pytest.raises(ConfigError, match=r"\(--max-skips "):
        relaunched(again)
    again.max_skips -= 1
    again.lr = 0.1
    with pytest.raises(ConfigError) as refused:
        relaunched(again)
    assert RESUME_RULE in str(refused.value) and "(--lr " in str(refused.value)
