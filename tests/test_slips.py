"""Slips of the hand and a machine too small (issue 45): a bandwidth or latency without its unit,
a run that cannot fit this machine, a misspelled option or recipe. Each is refused in one
sentence naming the fix, before anything is written; numbers lowband itself saved still read."""

import json
import os

import pytest

from lowband.config import Config, ConfigError
from lowband.flags import parse_train
from lowband.launch import fits
from lowband.units import parse_bandwidth, parse_duration


@pytest.mark.parametrize("args,said", [
    (["--link-bandwidth", "1000"], "--link-bandwidth 1000 has no unit: did you mean 1000Mbit? "
     "(write it with its unit: 1000Mbit, 1Gbit, 100kbit)."),
    (["--link-bandwidth", "1e9"], "--link-bandwidth 1e9 has no unit: did you mean 1Gbit?"),
    (["--link-latency", "10"], "--link-latency 10 has no unit: did you mean 10ms? "
     "(write it with its unit: 10ms, 1s, 150us)."),
    (["--link-latency", "0.02"], "--link-latency 0.02 has no unit: did you mean 20ms?"),
    (["--recipe", "mian"], "unknown recipe 'mian': did you mean main?"),
])
def test_a_slip_is_refused_with_what_was_meant(args, said):
    with pytest.raises(ConfigError) as refused:
        parse_train(args)
    assert str(refused.value).startswith(said), str(refused.value)


def test_values_with_units_zero_none_and_numbers_still_read(tmp_path):
    cfg, _ = parse_train(["--link-bandwidth", "1gbit", "--link-latency", "0"])
    assert (parse_bandwidth(cfg.link_bandwidth), parse_duration(cfg.link_latency)) == (1e9, 0)
    assert parse_train(["--link-bandwidth", "none"])[0].link_bandwidth == ""
    with pytest.raises(ConfigError, match="--link-bandwidth must be positive, got '0'"):
        parse_train(["--link-bandwidth", "0"])
    Config(link_bandwidth=1e8, link_latency=0.01).validate()  # numbers from Python: bit/s, s
    assert parse_bandwidth("1e9") == 1e9  # the readers (dashboard, report) take bare numbers
    # a run saved before bare numbers were refused is repeated and resumed as it ran
    run = tmp_path / "old"
    run.mkdir()
    saved = {**Config(model="nano").validate().to_dict(), "link_bandwidth": "5e7",
             "link_latency": "0.01"}
    (run / "config.json").write_text(json.dumps(saved))
    cfg = Config.from_file(str(run)).validate()
    assert (cfg.link_bandwidth, cfg.link_latency) == ("5e7bit", "0.01s")
    assert parse_bandwidth(cfg.link_bandwidth) == 5e7
    (run / "config.json").write_text(json.dumps({**saved, "link_bandwidth": 1e8}))  # train(cfg)'s
    assert Config.from_file(str(run)).validate().link_bandwidth == "100000000.0bit"
    assert parse_train(["--resume", str(run)])[0].link_bandwidth == "100000000.0bit"
    # a file a user wrote is what they typed: refused as the flag is
    (tmp_path / "mine.toml").write_text('link_latency = "10"\nsync-evry = 3\n')
    with pytest.raises(ConfigError, match="unknown key 'sync-evry' in .*did you mean sync-every?"):
        Config.from_file(str(tmp_path / "mine.toml"))
    (tmp_path / "mine.toml").write_text('link_latency = "10"\n')
    with pytest.raises(ConfigError, match="--link-latency 10 has no unit"):
        Config.from_file(str(tmp_path / "mine.toml")).validate()


def test_plan_and_sync_take_the_same_rule():
    from lowband.plan.cli import run_plan
    from lowband.sync.options import config_of

    with pytest.raises(ConfigError, match="--link-bandwidth 1000 has no unit"):
        run_plan(["--step-time", "0.1", "--link-bandwidth", "1000"])
    with pytest.raises(ConfigError, match="--link-latency 10 has no unit: did you mean 10ms?"):
        config_of("diloco", None, {"link_latency": "10"}, 4)
    with pytest.raises(ConfigError, match=r"^unknown option sync_evry: did you mean sync_every\? "):
        config_of("diloco", None, {"sync_evry": 10}, 4)
    with pytest.raises(ConfigError, match="unknown option colour: remove it"):
        config_of("diloco", None, {"colour": 10}, 4)


def _cfg(*args):
    return parse_train([*args, "--device", "cpu"])[0]


def test_what_cannot_fit_is_refused_and_what_fits_badly_noted():
    gb = 1e9
    assert fits.refusals(_cfg(), ranks=2, cores=2, available=16 * gb) == ([], [])
    refused, noted = fits.refusals(_cfg("--replicas", "9"), 9, cores=2, available=64 * gb)
    assert refused == ["9 ranks (--replicas 9 x --shards 1) on this machine's 2 cores would "
                       "crawl, more than 4 a core: lower --replicas or --shards."] and not noted
    refused, noted = fits.refusals(_cfg("--replicas", "3"), 3, cores=2, available=64 * gb)
    assert not refused and noted[0].startswith("3 ranks (--replicas 3 x --shards 1) share")
    # memory: the estimate of a worker, its workers' total and what is available, in one sentence
    long = _cfg("--seq-len", "100000")
    model, activations = fits.worker_bytes(long)
    each = fits.BASE_BYTES + model + activations
    assert 20 * gb < each < 40 * gb  # 8 x 100000 tokens through 4 blocks of width 128
    refused, _ = fits.refusals(long, 2, cores=8, available=1.1 * gb)
    assert refused == [f"--seq-len 100000 with --batch-size 8 needs about {each / gb:.1f} GB a "
                       f"worker, {2 * each / gb:.1f} GB for 2 workers, and this machine has 1.1 "
                       "GB available: lower --seq-len, --batch-size or --replicas."]
    refused, noted = fits.refusals(long, 2, cores=8, available=2.5 * each)
    assert not refused and noted[0].endswith("the run may swap, or be stopped for memory.")
    refused, _ = fits.refusals(_cfg("--model", "gpt2"), 2, cores=8, available=1 * gb)
    assert "--model gpt2 needs about" in refused[0] and "pick a smaller --model" in refused[0]
    assert fits.refusals(long, 2, cores=8, available=1 * gb, on_cpu=False) == ([], [])
    assert fits.refusals(long, 2, cores=8, available=None) == ([], [])  # unknown: not checked


def test_fit_here_refuses_unless_oversubscribed(monkeypatch, capsys):
    monkeypatch.setattr(fits, "available_bytes", lambda: 64e9)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    with pytest.raises(ConfigError, match=r"lower --replicas or --shards, or pass "
                       r"--oversubscribe to start anyway\.$"):
        fits.fit_here(_cfg("--replicas", "9"))
    fits.fit_here(_cfg("--replicas", "9", "--oversubscribe"))
    assert capsys.readouterr().err.startswith("lowband: note: 9 ranks (--replicas 9 x --shards")
    with pytest.raises(ConfigError, match="^9 ranks"):  # under torchrun: refused as well,
        fits.fit_here(_cfg("--replicas", "9"), ranks=9, notes=False)
    fits.fit_here(_cfg("--replicas", "3"), ranks=3, notes=False)  # but with no note
    assert capsys.readouterr().err == ""


def test_a_huge_run_is_refused_before_any_worker_starts(tmp_path, lowband_here):
    code, stderr = lowband_here("train", "--replicas", 4096, "--run-dir", tmp_path / "r",
                                cwd=tmp_path)
    assert code == 2 and stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert stderr.startswith("lowband: error: 4096 ranks (--replicas 4096 x --shards 1) on ")
    assert stderr.endswith("or pass --oversubscribe to start anyway.\n")
    assert not (tmp_path / "r").exists() and not (tmp_path / "runs").exists()
