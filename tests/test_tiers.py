"""The test tiers (README, "Run the tests"): the markers are registered in pyproject.toml, where
--strict-markers makes an unregistered one an error, and named in the README; the quick tier
(`-m "not slow"`) collects every test but the slow ones; a test that skips without test hosts
(root) or without CUDA carries root or gpu, and the Slurm tests slurm and root, so `-m` selects
each machine's tests."""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
MARKERS = {line.split(":")[0] for line in OPTIONS["markers"]}

# One collection: every test with its markers (before -m deselects any), then what -m kept.
COLLECT = '''
import json, sys, pytest

class Record:
    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items):
        self.all = {i.nodeid: [[m.name, str(m.kwargs.get("reason", ""))]
                               for m in i.iter_markers()] for i in items}

    def pytest_collection_finish(self, session):
        self.kept = [i.nodeid for i in session.items]

record = Record()
pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[record])
print("RECORD" + json.dumps([record.all, record.kept]))
'''
# what a skip reason says a test needs, and the marker that says it
NEEDS = {"test hosts": "root", "network namespaces": "root", "encrypted test link": "root",
         "CUDA": "gpu"}


@pytest.fixture(scope="module")
def quick():
    """({test: [[marker, reason], ...]} of the whole suite, [the tests -m "not slow" keeps])."""
    proc = subprocess.run([sys.executable, "-c", COLLECT, "-m", "not slow"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert "RECORD" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RECORD", 1)[1])


def test_the_markers_are_registered_strict_and_in_the_readme():
    assert "--strict-markers" in OPTIONS["addopts"].split()
    assert {"slow", "root", "gpu", "slurm", "browser"} <= MARKERS
    tests = (ROOT / "README.md").read_text().split("## Run the tests", 1)[1].split("\n## ", 1)[0]
    for marker in MARKERS:
        assert f"`{marker}`" in tests, f"the README's 'Run the tests' does not name {marker}"


def test_the_quick_tier_is_every_test_but_the_slow_ones(quick):
    every, kept = quick
    slow = {test for test, marks in every.items() if "slow" in {m for m, _ in marks}}
    assert slow and kept and set(kept) == set(every) - slow
    used = {m for marks in every.values() for m, _ in marks}
    builtin = {"parametrize", "skip", "skipif", "xfail", "usefixtures", "filterwarnings"}
    assert used - builtin <= MARKERS


def test_a_test_that_needs_a_machine_is_marked_for_it(quick):
    every, _ = quick
    for test, marks in every.items():
        names = {m for m, _ in marks}
        for need, marker in NEEDS.items():
            if any(name == "skipif" and need in reason for name, reason in marks):
                assert marker in names, f"{test} skips without {need}: mark it {marker}"
        if test.startswith("tests/test_slurm.py::"):
            assert {"slurm", "root"} <= names, test
    assert sum("root" in {m for m, _ in marks} for marks in every.values()) >= 10
    assert sum("gpu" in {m for m, _ in marks} for marks in every.values()) >= 3
