"""A real browser: JupyterLab runs 01-quickstart in headless Chromium, and a report opens offline.

The test starts JupyterLab itself on a free loopback port with a token of its own, serving a
temporary copy of the notebook (in small mode), opens it with Playwright, runs every cell through
the Run menu and, while the run trains, reads the loss figure's data in the page: the number of
points it draws must grow between readings, and the sync timeline must draw bars. Then
`lowband report` makes the offline report of the run, and the report is opened with every
request other than file:// blocked: each plot must draw data. Screenshots go to
test-artifacts/browser/.

Needs Debian's chromium at /usr/bin/chromium and the `playwright` Python package (whose own
browser download is never used); skipped with a message when either is missing.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.browser]
CHROMIUM = os.environ.get("LOWBAND_CHROMIUM", "/usr/bin/chromium")
if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium, or set LOWBAND_CHROMIUM)",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api",
                               reason="the playwright package is missing (pip install playwright)")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("jupyterlab")
pytest.importorskip("torchx")

from lowband.launch.local import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts" / "browser"
STEPS = 1000   # long enough (10-20 s) to read the loss figure several times while it trains
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]

# Each plotly figure of the page: its title, its traces (name, type, number of x values, from
# the data plotly.js drew) and the bars drawn in its SVG.
FIGURES_JS = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(gd => {
    const full = gd._fullData || [];
    const title = (gd.layout && gd.layout.title && (gd.layout.title.text ?? gd.layout.title)) || '';
    return {
        id: gd.id || '', title: String(title),
        traces: full.map(t => ({name: t.name || '', type: t.type || 'scatter',
                                n: t.x ? t.x.length : 0})),
        bars: gd.querySelectorAll('.barlayer .point').length,
    };
})"""


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def lab(tmp_path):
    """JupyterLab serving a copy of 01-quickstart in small mode; yields (url, run_root)."""
    root = tmp_path / "lab"
    root.mkdir()
    runs = tmp_path / "runs"
    nb = nbformat.read(ROOT / "notebooks" / "01-quickstart.ipynb", as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    injected = nbformat.v4.new_code_cell(
        f"SMALL = True\nSTEPS = {STEPS}\nRUN_ROOT = {str(runs)!r}",
        metadata={"tags": ["injected-parameters"]})
    injected.id = "injected-parameters"
    nb.cells.insert(nb.cells.index(cell) + 1, injected)
    nbformat.write(nb, root / "01-quickstart.ipynb")
    shutil.copytree(ROOT / "examples", tmp_path / "examples")  # beside it, as in a checkout

    port, token = free_port(), secrets.token_hex(16)
    jupyter_dirs = {k: str(tmp_path / "jupyter" / k.lower()) for k in
                    ("JUPYTER_CONFIG_DIR", "JUPYTER_RUNTIME_DIR", "IPYTHONDIR")}
    log = open(tmp_path / "jupyterlab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
         "--ip", "127.0.0.1", f"--port={port}", "--port-retries=0",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
         f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
         "--LabApp.news_url=None",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        cwd=root, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, **jupyter_dirs,   # kernels run `python`: this interpreter
             "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])},
        start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    pytest.fail("JupyterLab did not start:\n" +
                                (tmp_path / "jupyterlab.log").read_text()[-3000:])
                time.sleep(0.3)
        yield f"{base}/lab/tree/01-quickstart.ipynb?token={token}", runs
    finally:
        try:   # the server's own shutdown also stops its kernels (and the jobs they launched)
            urllib.request.urlopen(urllib.request.Request(
                f"{base}/api/shutdown?token={token}", method="POST"), timeout=10).close()
            server.wait(timeout=30)
        except Exception:
            pass
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp_path / "jupyterlab.log", ARTIFACTS / "jupyterlab.log")


def wait_for_kernel(page, url: str, timeout: float = 90) -> None:
    """Until the notebook's kernel is up and idle (asked through the server's REST API). Lab may
    ask which kernel to start (when its kernel list came late): the default is python3, take it."""
    base, token = url.split("/lab/")[0], url.split("token=")[1]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        select = page.locator(".jp-Dialog button", has_text="Select")
        if select.count():
            select.first.click()
        with urllib.request.urlopen(f"{base}/api/sessions?token={token}", timeout=5) as r:
            sessions = json.load(r)
        if any(s["path"].endswith("01-quickstart.ipynb") and s["kernel"]
               and s["kernel"]["execution_state"] == "idle" for s in sessions):
            return
        time.sleep(0.3)
    pytest.fail(f"the notebook's kernel did not start within {timeout} s")


def figures(page) -> dict[str, dict]:
    """The page's figures by title, the first of each: the quickstart's own dashboard's (the
    dashboard of the notebook's own-loop run comes after it)."""
    return {f["title"] or f["id"]: f for f in reversed(page.evaluate(FIGURES_JS))}


def loss_points(figs) -> int:
    fig = figs.get("loss")
    return sum(t["n"] for t in fig["traces"] if "replica" in t["name"]) if fig else 0


def test_quickstart_runs_live_in_jupyterlab(browser, lab):
    url, runs = lab
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1400, "height": 1600})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(url, wait_until="domcontentloaded", timeout=90_000)
        page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=90_000)
        wait_for_kernel(page, url)
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator("li.lm-Menu-item[data-command='runmenu:run-all']").click()

        # while the job trains: read the loss figure again and again
        readings, timeline_bars = [], 0
        done = page.locator(".jp-OutputArea-output", has_text="checks passed")
        deadline = time.monotonic() + 240
        while not done.count() and time.monotonic() < deadline:
            figs = figures(page)
            if "loss" in figs:
                readings.append(loss_points(figs))
                tl = next((f for t, f in figs.items() if t.startswith("sync timeline")), None)
                if tl:
                    timeline_bars = max(timeline_bars, tl["bars"])
            if len(readings) == 8:   # mid-run, with the dashboard in view
                page.locator(".js-plotly-plot").first.scroll_into_view_if_needed()
                page.screenshot(path=ARTIFACTS / "quickstart-live.png")
            time.sleep(0.4)
        plots = page.locator(".js-plotly-plot")
        if plots.count():
            plots.first.scroll_into_view_if_needed()
        page.screenshot(path=ARTIFACTS / "quickstart.png")
        assert done.count(), (
            f"the notebook did not get to its checks (loss points read: {readings}; page "
            f"errors: {errors}); its error outputs: " + " | ".join(page.locator(
                ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
            ).all_inner_texts())[-3000:])
        final = figures(page)
    finally:
        page.close()

    (ARTIFACTS / "loss-readings.json").write_text(json.dumps(readings) + "\n")
    # the trace gained points while the run progressed: two readings in a row, both before
    # the end, increasing
    during = [n for n in readings if 0 < n < 2 * STEPS]
    assert len(set(during)) >= 2 and sorted(during) == during, readings
    assert loss_points(final) == 2 * STEPS, final.get("loss")
    tl = next(f for t, f in final.items() if t.startswith("sync timeline"))
    assert max(timeline_bars, tl["bars"]) > 0, tl
    assert any(t["n"] for t in final["outer-link bandwidth"]["traces"])
    assert not errors, errors

    # the offline report of that run, with the network blocked
    run_dir = runs / "streaming"
    out = runs / "report.html"
    proc = subprocess.run([sys.executable, "-m", "lowband.cli", "report", str(run_dir),
                           "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_report_offline(browser, out, ARTIFACTS / "report.png")


def check_report_offline(browser, path: Path, screenshot: Path) -> None:
    context = browser.new_context(viewport={"width": 1300, "height": 1000})
    blocked = []

    def route(r):
        if r.request.url.startswith("file://"):
            r.continue_()
        else:
            blocked.append(r.request.url)
            r.abort()

    context.route("**/*", route)
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(path.as_uri(), wait_until="load", timeout=60_000)
        page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length"
                               " >= 3", timeout=60_000)
        figs = page.evaluate(FIGURES_JS)
        page.screenshot(path=screenshot, full_page=True)
        data = json.loads(page.locator("#lowband-report-data").text_content())
    finally:
        context.close()
    ids = {f["id"] for f in figs}
    assert {"lowband-loss", "lowband-bandwidth", "lowband-timeline-0"} <= ids, ids
    for f in figs:   # every plot drew data
        assert any(t["n"] for t in f["traces"]), f
    timeline = next(f for f in figs if f["id"] == "lowband-timeline-0")
    assert timeline["bars"] > 0
    assert data["runs"][0]["finished"]
    assert not blocked, f"the report fetched from the network: {blocked[:5]}"
    assert not errors, errors
