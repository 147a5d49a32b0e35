"""The defaults are the main job's: a flag of `lowband train` changes only what it names, --help
shows the main job's values, `--link-bandwidth none` is the way to no emulated link, and
`lowband` alone prints the help. All in this process: parsing, no training."""

import pytest

from lowband import recipes
from lowband.cli import COMMANDS, main
from lowband.comm.link import LinkOptions
from lowband.config import Config, ConfigError
from lowband.flags import parse_train, train_parser


def test_the_main_recipe_is_the_defaults():
    assert recipes.main.values == {}
    main_job = recipes.main().to_dict()
    assert main_job == Config().validate().to_dict() == parse_train([])[0].to_dict()
    cfg = Config().validate()
    assert (cfg.algo, cfg.model, cfg.replicas, cfg.steps, cfg.sync_every, cfg.fragments) == \
        ("streaming", "micro", 2, 200, 20, 4)
    assert (cfg.link_bandwidth, cfg.link_latency) == ("100Mbit", "10ms")


def test_a_flag_changes_only_what_it_names():
    cfg, resume = parse_train(["--steps", "20"])
    assert not resume and cfg.to_dict() == recipes.main(steps=20).to_dict()


def test_algo_ddp_is_the_baseline_over_the_same_link():
    cfg, _ = parse_train(["--algo", "ddp"])
    assert cfg.to_dict() == recipes.ddp().to_dict()
    assert (cfg.algo, cfg.link_bandwidth, cfg.link_latency) == ("ddp", "100Mbit", "10ms")
    assert cfg.ignored() == []  # streaming's defaults (--sync-every 20) are no note for ddp
    for algo in ("diloco", "zero1", "acco", "edit", "aedit"):  # none refused for a default
        assert parse_train(["--algo", algo])[0].ignored() == []


def test_a_smaller_model_takes_fewer_fragments_unless_they_are_given():
    assert parse_train(["--model", "nano"])[0].fragments == 2  # nano's 2 blocks
    with pytest.raises(ConfigError, match="more than the model's 2 blocks"):
        parse_train(["--model", "nano", "--fragments", "4"])


@pytest.mark.parametrize("value", ["none", "None", ""])
def test_no_emulated_link(value):
    cfg, _ = parse_train(["--link-bandwidth", value, "--steps", "20"])
    assert (cfg.link_bandwidth, cfg.link_latency) == ("", "0ms")  # recorded as no link at all
    assert LinkOptions.build(cfg) is None
    assert cfg.to_dict() == recipes.main(steps=20, link_bandwidth="none").to_dict()
    assert recipes.quickstart().link_bandwidth == ""  # recipes state their link


def test_help_shows_the_main_jobs_values_as_defaults():
    text = " ".join(train_parser().format_help().split())
    for shown in ("training algorithm: ddp, diloco, streaming", "(default: 'streaming')",
                  "(default: '100Mbit')", "(default: '10ms')", "(default: 'micro')",
                  "--link-bandwidth none: no emulated link"):
        assert shown in text, shown


def test_lowband_alone_prints_the_help(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for argv in ([], ["--help"]):
        assert main(argv) == 0
        out, err = capsys.readouterr()
        assert err == "" and out.startswith("usage: lowband COMMAND")
        assert all(f"\n  {name} " in out for name in COMMANDS)  # each command, one line
        assert "`lowband train`" in out and "--algo ddp" in out
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing written
