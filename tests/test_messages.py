"""Messages that point the right way (issue 31, a newcomer's first hour): each slip gets one
sentence that names what was given and the fix, before anything is written; the README's example
of a refused option is one lowband refuses; a redirected log gets no progress bar. In this
process where the refusal comes before any worker (conftest's lowband_here)."""

import io
import os
import re
import sys

import pytest

from conftest import ROOT, hf_config, train_in_one_job
from lowband.config import Config
from lowband.flags import parse_train

TINY = ["--replicas", 1, "--steps", 2, "--seq-len", 32, "--batch-size", 4, "--eval-every", 0,
        "--eval-batches", 1, "--no-progress"]


def one_sentence(code: int, stderr: str) -> bool:
    return code == 2 and stderr.count("\n") == 1 and "Traceback" not in stderr


@pytest.mark.parametrize("argv,meant", [
    (["train", "--step", 20], "did you mean --steps?"),
    (["train", "--model", "nano", "--sync-ev", 4],
     "did you mean --sync-every or --sync-every-warmup?"),  # each option it begins
    (["train", "--stepz", 20], "did you mean --steps?"),  # a slip, not an abbreviation
    (["plan", "--step-t", "0.1"], "did you mean --step-time?"),
    (["plan", "--link-b", "1gbit"], "did you mean --link-bandwidth?"),  # not --link (a file)
    (["prepare", "src", "-o", "out", "--tokenizer", "t.json", "--overwr"],
     "did you mean --overwrite?"),
    (["export", "run", "-o", "out", "--whi", "outer"], "did you mean --which?"),
    (["report", "run", "--tit", "x"], "did you mean --title?"),
])
def test_abbreviations_are_refused_naming_the_option(tmp_path, lowband_here, argv, meant):
    code, stderr = lowband_here(*argv, cwd=tmp_path)
    assert one_sentence(code, stderr) and "unrecognized arguments: " in stderr, stderr
    assert meant in stderr, stderr
    assert list(tmp_path.iterdir()) == []


def test_the_launchers_own_parsers_refuse_abbreviations(monkeypatch):
    import importlib

    from lowband.testing.slurm_cluster import main as slurm_cluster

    lighthouse = importlib.import_module("lowband.launch.lighthouse")

    def taken(*args, **kwargs):
        raise AssertionError("--run was taken for --run-dir")

    monkeypatch.setattr(lighthouse, "lighthouse", taken)
    with pytest.raises(SystemExit) as e:
        lighthouse.main(["--replicas", "2", "--run", "r"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        slurm_cluster(["status", "--node", "3"])  # --nodes
    assert e.value.code == 2


def test_an_unknown_scheduler_names_the_schedulers(tmp_path, lowband_here):
    pytest.importorskip("torchx")
    code, stderr = lowband_here("launch", "-s", "slurmm", "--model", "nano", cwd=tmp_path)
    assert one_sentence(code, stderr), stderr
    assert "unknown scheduler 'slurmm': use one of " in stderr, stderr
    assert "local_cwd, " in stderr and "slurm, " in stderr and "kubernetes" in stderr
    assert "dict_keys" not in stderr and "run options" not in stderr
    assert list(tmp_path.iterdir()) == []


def test_plan_names_a_count_it_cannot_read(tmp_path, lowband_here, monkeypatch):
    from lowband.plan import probe

    def probed(cfg):
        raise AssertionError("probed before reading --params")

    monkeypatch.setattr(probe, "step_time", probed)
    for argv in (["--params", "abc"], ["--params", "abc", "--step-time", "0.1"],
                 ["--params", "abc", "--step-time", "probe"],  # before the probe
                 ["--params", "abc", "--recipe", "main", "--json"]):
        code, stderr = lowband_here("plan", *argv, cwd=tmp_path)
        assert one_sentence(code, stderr) and "cannot read --params 'abc'" in stderr, (argv, stderr)


def test_a_model_directory_without_hf_is_pointed_to_hf(tmp_path, lowband_here):
    llama = hf_config(tmp_path).name
    code, stderr = lowband_here("train", "--model", f"{llama}/", cwd=tmp_path)
    assert one_sentence(code, stderr) and f"give --model hf:{llama}/." in stderr, stderr
    code, stderr = lowband_here("train", "--model", "huge", cwd=tmp_path)  # no such path
    assert one_sentence(code, stderr) and "use one of" in stderr and "hf:huge" not in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [llama]


def test_the_readme_example_of_a_refused_option_is_refused(tmp_path, lowband_here):
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"\(`(--[\w-]+)` with `--algo (\w+)`\) is refused", readme)
    assert found, "the README names an option refused with an algorithm"
    option, algo = found.groups()
    value = {"--codec": "int8"}.get(option, "1")
    code, stderr = lowband_here("train", "--algo", algo, option, value, cwd=tmp_path)
    assert one_sentence(code, stderr) and f"{option} applies only to" in stderr, stderr
    assert parse_train(["--algo", "edit", "--codec", "int8"])[0].codec == "int8"  # edit takes it


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """(its directory, the model's) of a finished run without checkpoints, of a Hugging Face
    model given by a path relative to the directory it trained in."""
    root = tmp_path_factory.mktemp("relative")
    llama = hf_config(root / "models")
    here = os.getcwd()
    os.chdir(root)  # the workers start here too
    try:
        train_in_one_job(["--model", "hf:models/" + llama.name, *TINY, "--run-dir", "run"])
    finally:
        os.chdir(here)
    return root / "run", llama


@pytest.mark.slow
def test_a_relative_model_path_is_recorded_absolute(finished, tmp_path, lowband_here):
    run, llama = finished
    assert Config.from_file(str(run)).model == f"hf:{llama.resolve()}"
    (tmp_path / "elsewhere").mkdir()
    code, stderr = lowband_here("export", run, "-o", tmp_path / "exported",
                                cwd=tmp_path / "elsewhere")
    assert code == 0, stderr
    assert (tmp_path / "exported" / "config.json").is_file()


def test_resume_without_checkpoints_is_refused_before_any_worker(finished, tmp_path, lowband_here):
    run = finished[0]
    before = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in run.rglob("*")}
    code, stderr = lowband_here("train", "--resume", run, cwd=tmp_path)
    assert one_sentence(code, stderr) and "has no checkpoint to resume from" in stderr, stderr
    assert {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in run.rglob("*")} == before


def test_prepare_names_what_differs_and_a_touch_is_no_change(tok, tmp_path, lowband_here):
    src = tmp_path / "src"
    src.mkdir()
    for name, text in (("a.txt", tok[2][:3000]), ("b.txt", tok[2][3000:6000])):
        (src / name).write_text(text)
    prepare = ["prepare", "src", "-o", "out", "--tokenizer", tok[0], "--workers", 1]
    code, stderr = lowband_here(*prepare, cwd=tmp_path)  # a progress bar only on a terminal
    assert code == 0 and "tokenizing" not in stderr, stderr
    written = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir() if p.is_file()}

    os.utime(src / "a.txt", ns=(1, 1))  # touched: the same contents
    assert lowband_here(*prepare, cwd=tmp_path)[0] == 0
    (src / "c.txt").write_text("new")
    code, stderr = lowband_here(*prepare, cwd=tmp_path)
    assert one_sentence(code, stderr) and "from other sources (c.txt is new)" in stderr, stderr
    (src / "c.txt").unlink()
    text = (src / "b.txt").read_text()
    (src / "b.txt").write_text(text[:-1] + ("x" if text[-1] != "x" else "y"))  # the same size
    code, stderr = lowband_here(*prepare, cwd=tmp_path)
    assert one_sentence(code, stderr) and "from other sources (b.txt changed)" in stderr, stderr
    code, stderr = lowband_here(*prepare, "--shard-tokens", 5000, cwd=tmp_path)
    assert one_sentence(code, stderr) and "with --shard-tokens 100000000 (now 5000)" in stderr
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir() if p.is_file()} == written


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("stream,drawn", [(io.StringIO(), False), (Terminal(), True)])
def test_the_progress_bar_is_drawn_only_on_a_terminal(monkeypatch, stream, drawn):
    from lowband.train import _progress

    monkeypatch.setattr(sys, "stderr", stream)
    bar = _progress(Config(model="nano", steps=40).validate(), rank=0)
    for _ in range(40):
        bar.update(1)
    bar.close()
    assert bool(stream.getvalue()) == drawn, stream.getvalue()
