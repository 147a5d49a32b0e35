"""The install a user runs and what a missing extra says.

Every command that needs an optional extra (pyproject.toml) and does not find it ends with one
sentence naming it (`pip install 'lowband[X]'`), exit status 2, and nothing written. The module
is hidden in this process (sys.modules[name] = None, as if it were not installed), and each
command runs in-process (conftest.lowband_here)."""

import re
import sys

import pytest

from lowband.options import ConfigError, needs_extra

NANO = ["--model", "nano", "--steps", "2", "--no-progress"]

# (the module hidden, the extra the sentence names, the command line)
MISSING = [
    ("transformers", "hf", ["train", "--model", "hf:model", *NANO[2:]]),
    ("transformers", "hf", ["plan", "--model", "hf:model"]),
    ("transformers", "hf", ["export", "run", "-o", "out"]),
    ("tokenizers", "hf", ["train", "--tokenizer", "tok.json", "--data", "corpus", *NANO]),
    ("tokenizers", "hf", ["prepare", "corpus", "-o", "out", "--tokenizer", "tok.json"]),
    ("plotly", "ui", ["report", "run", "-o", "out.html"]),
    ("plotly", "ui", ["compare", "--algos", "ddp,streaming", *NANO]),
    ("torchx", "launch", ["launch", "--dryrun", "--", *NANO]),
    ("torchft", "elastic", ["train", "--elastic", "--replicas", "2", *NANO]),
    ("torchft", "elastic", ["launch", "--dryrun", "--", "--elastic", "--replicas", "2", *NANO]),
]


@pytest.mark.parametrize("module,extra,argv", MISSING, ids=lambda v: v if isinstance(v, str) else
                         " ".join(v[:2]))
def test_a_missing_extra_is_one_sentence_and_writes_nothing(tmp_path, monkeypatch, lowband_here,
                                                            module, extra, argv):
    if module == "torchft" and argv[0] == "launch":
        pytest.importorskip("torchx")  # the launch extra is there; only torchft is missing
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "tok.json").write_text("{}")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("some text\n")
    (tmp_path / "cache").mkdir()  # where --tokenizer's tokens would be cached
    monkeypatch.setenv("LOWBAND_CACHE", str(tmp_path / "cache"))
    before = sorted(p.name for p in tmp_path.iterdir())
    monkeypatch.setitem(sys.modules, module, None)
    code, stderr = lowband_here(*argv, cwd=tmp_path)
    assert code == 2, stderr
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert f"needs the {extra} extra ({module} is not installed): pip install 'lowband[{extra}]'." \
        in stderr, stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no run directory, no output
    assert not any((tmp_path / "cache").iterdir())


def test_parquet_sources_need_pyarrow(tmp_path, monkeypatch):
    from lowband.data.prepare import source_files

    (tmp_path / "a.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ConfigError, match=re.escape("Parquet sources needs the hf extra (pyarrow "
                                                    "is not installed): pip install 'lowband[hf]'.")):
        source_files(tmp_path)


def test_needs_extra_passes_what_is_installed(monkeypatch):
    needs_extra("hf", "json", "json")  # a module that is there: nothing said
    monkeypatch.setitem(sys.modules, "json", None)
    with pytest.raises(ConfigError, match=r"^x needs the hf extra \(json is not installed\)"):
        needs_extra("hf", "x", "json")
