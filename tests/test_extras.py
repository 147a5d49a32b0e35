"""The install a user runs and what a missing extra says.

Every command that needs an optional extra (pyproject.toml) and does not find it ends with one
sentence naming it (`pip install 'lowband[X]'`), exit status 2, and nothing written. The module
is hidden in this process (sys.modules[name] = None, as if it were not installed), and each
command runs in-process (conftest.lowband_here). The extras themselves: `user` is what running
lowband needs (the README's install, no test tools), `all` adds the Kubernetes client,
pyarrow and Lightning, `test` the test tools, and the README's test command installs `test`."""

import re
import sys
import tomllib
from pathlib import Path

import pytest

from lowband.options import ConfigError, needs_extra

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]
NANO = ["--model", "nano", "--steps", "2", "--no-progress"]

# (the module hidden, the extra the sentence names, the command line)
MISSING = [
    ("transformers", "hf", ["train", "--model", "hf:model-without-hf", *NANO[2:]]),
    ("transformers", "hf", ["plan", "--model", "hf:model-without-hf"]),
    ("transformers", "hf", ["export", "run", "-o", "out"]),
    ("tokenizers", "hf", ["train", "--tokenizer", "tok.json", "--data", "corpus", *NANO]),
    ("tokenizers", "hf", ["prepare", "corpus", "-o", "out", "--tokenizer", "tok.json"]),
    ("plotly", "ui", ["report", "run", "-o", "out.html"]),
    ("plotly", "ui", ["compare", "--algos", "ddp,streaming", *NANO]),
    ("torchx", "launch", ["launch", "--dryrun", "--", *NANO]),
    ("torchft", "elastic", ["train", "--elastic", "--replicas", "2", *NANO]),
    ("torchft", "elastic", ["launch", "--dryrun", "--", "--elastic", "--replicas", "2", *NANO]),
    ("kubernetes", "kubernetes", ["launch", "--dryrun", "-s", "kubernetes", "--", *NANO]),
]


@pytest.mark.parametrize("module,extra,argv", MISSING, ids=lambda v: v if isinstance(v, str) else
                         " ".join(v[:2]))
def test_a_missing_extra_is_one_sentence_and_writes_nothing(tmp_path, monkeypatch, lowband_here,
                                                            module, extra, argv):
    if argv[0] == "launch" and module != "torchx":
        pytest.importorskip("torchx")  # the launch extra is there; only `module` is missing
    (tmp_path / "model-without-hf").mkdir()
    (tmp_path / "model-without-hf" / "config.json").write_text('{"model_type": "llama"}')
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
    with pytest.raises(ConfigError, match=re.escape("a.parquet' (Parquet) needs the parquet extra "
                                                    "(pyarrow is not installed): pip install "
                                                    "'lowband[parquet]'.")):
        source_files(tmp_path)


def test_the_dashboard_needs_the_ui_extra(monkeypatch):
    import lowband.dashboard

    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    with pytest.raises(ConfigError, match=re.escape("the Dashboard needs the ui extra (ipywidgets "
                                                    "is not installed): pip install 'lowband[ui]'.")):
        _ = lowband.dashboard.Dashboard


def test_needs_extra_passes_what_is_installed(monkeypatch):
    needs_extra("hf", "json", "json")  # a module that is there: nothing said
    monkeypatch.setitem(sys.modules, "json", None)
    with pytest.raises(ConfigError, match=r"^x needs the hf extra \(json is not installed\)"):
        needs_extra("hf", "x", "json")


def _names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+(\[[^]]*\])?", r).group(0) for r in requirements}


def test_the_user_install_has_no_test_tools_and_the_test_extra_has_them():
    assert _names(EXTRAS["user"]) == {"lowband[ui,launch,hf,elastic]"}
    assert _names(EXTRAS["all"]) == {"lowband[user,kubernetes,parquet,lightning]"}
    user = set().union(*(_names(EXTRAS[x]) for x in ("ui", "launch", "hf", "elastic")))
    tools = {"pytest", "hypothesis", "playwright", "triton"}
    assert not (tools | {"pyarrow", "kubernetes", "datasets", "lightning"}) & user
    assert _names(EXTRAS["test"]) >= {"lowband[all]"} | tools


def test_every_extra_a_command_names_exists():
    code = "\n".join(p.read_text() for p in (ROOT / "toolkit" / "lowband").rglob("*.py"))
    named = set(re.findall(r"""needs_extra\(\s*["'](\w+)["']""", code))
    for constant in set(re.findall(r"needs_extra\(\*(\w+)\)", code)):  # (extra, what, module)
        named |= set(re.findall(rf"""^{constant} = \(["'](\w+)["']""", code, re.M))
    assert named <= set(EXTRAS), named - set(EXTRAS)
    assert {"hf", "ui", "launch", "elastic"} <= named


def test_readme_installs_user_and_tests_with_the_test_extra_as_ci_does():
    readme = (ROOT / "README.md").read_text()
    assert 'pip install -c constraints.txt -e ".[user]"' in readme.split("## Run the tests")[0]
    block = readme.split("## Run the tests")[1].split("```bash\n")[1].split("```")[0]
    assert block.splitlines() == ['pip install -c constraints.txt -e ".[test]"',
                                  "python -m pytest -q"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "## Run the tests" in ci and 'eval "${readme[0]}"' in ci and 'eval "${readme[1]}"' in ci


def test_the_license_is_declared_and_there():
    assert PYPROJECT["project"]["license"] == "BSD-3-Clause"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License") and "the lowband authors" in text
