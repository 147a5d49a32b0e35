"""Every notebook in notebooks/ runs headless, in small mode, without an error.

Like papermill, the parameters are set by a cell inserted after the one tagged `parameters`
(SMALL = True, RUN_ROOT in the test's temporary directory); nbclient then runs every cell in a
python3 kernel started in that directory. The notebooks' own assertion cells check what they
show. The executed notebooks are kept under test-artifacts/notebooks/ for a look afterwards.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # measured (--durations): README, Run the tests

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("torchx")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
ARTIFACTS = ROOT / "test-artifacts" / "notebooks"


@pytest.fixture(autouse=True)
def this_python_first(monkeypatch):
    """The kernelspec runs `python`: make it this interpreter, venv activated or not."""
    monkeypatch.setenv("PATH", os.pathsep.join([os.path.dirname(sys.executable),
                                                os.environ.get("PATH", "")]))


def with_parameters(nb, **params):
    """Insert a cell setting `params` right after the cell tagged `parameters` (papermill's
    convention: the notebook's defaults stay visible, the injected values win)."""
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, "a notebook needs exactly one cell tagged `parameters`"
    source = "\n".join(f"{k} = {v!r}" for k, v in params.items())
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    cell.id = "injected-parameters"
    nb.cells.insert(tagged[0] + 1, cell)
    return nb


def test_notebooks_exist():
    names = [p.name for p in NOTEBOOKS]
    assert names[:3] == ["01-quickstart.ipynb", "02-compare-algorithms.ipynb",
                         "03-slow-links.ipynb"], names


def test_notebooks_are_stored_without_outputs():
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, \
                    f"{path.name}: clear the outputs before committing"


def _browser_runs(name: str) -> bool:
    """tests/test_browser.py runs 01-quickstart live in JupyterLab, every cell in small mode,
    where Chromium and Playwright are here: running it here too would only cost CI time."""
    import importlib.util

    return (name == "01-quickstart.ipynb"
            and Path(os.environ.get("LOWBAND_CHROMIUM", "/usr/bin/chromium")).exists()
            and importlib.util.find_spec("playwright") is not None
            and importlib.util.find_spec("jupyterlab") is not None)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_small_mode(path, tmp_path):
    if _browser_runs(path.name):
        pytest.skip("tests/test_browser.py runs this notebook in JupyterLab")
    nb = with_parameters(nbformat.read(path, as_version=4), SMALL=True,
                         RUN_ROOT=str(tmp_path / "runs"))
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=240, startup_timeout=120,
        resources={"metadata": {"path": str(tmp_path)}}, store_widget_state=False)
    try:
        client.execute()
    finally:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, ARTIFACTS / path.name)
