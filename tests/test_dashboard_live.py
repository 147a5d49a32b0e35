"""The dashboard's live path through a real kernel: a writer process appends events while a
python3 kernel (started with jupyter_client) shows a Dashboard of the run.

Checks that displaying it returns at once while the run goes on, that the figures it holds keep
growing between two reads made through the kernel, that widget updates (comm messages) reach
the frontend side in between, and that it stops polling once summary.json appears.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import textwrap
import time

import pytest

jupyter_client = pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")
pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from lowband.telemetry import RunDir, write_json_atomic  # noqa: E402

pytestmark = pytest.mark.slow  # measured (--durations): README, Run the tests

# Two ranks writing as a trainer does, in real time, until a stop file appears (or 60 s pass):
# a step event per rank every 20 ms, an outer transfer and a sync every 10 steps; then the run
# end and summary.json.
WRITER = textwrap.dedent("""
    import math, pathlib, sys, time
    from lowband.telemetry import EventWriter, RunDir, write_json_atomic
    rd = RunDir(sys.argv[1])
    stop = pathlib.Path(sys.argv[2])
    writers = [EventWriter(rd, r, r) for r in range(2)]
    t0 = time.time()
    for w in writers:
        w.emit("run", phase="start", world=2, config_hash="live-test")
    step = 0
    while not stop.exists() and time.time() - t0 < 60:
        step += 1
        for w in writers:
            now = time.time()
            w.emit("step", step=step, loss=2 + 3 * math.exp(-step / 100) + 0.01 * w.rank,
                   lr=1e-3, tokens=256 * step, step_s=0.02, compute_s=0.018)
            if step % 10 == 0:
                w.emit("comm", op="all_reduce", group="outer", tag=f"frag{step // 10 % 2}",
                       payload_bytes=40000, wire_bytes=5000, codec="fp4-e3m0",
                       start=now - 0.004, end=now)
                w.emit("sync", step=step, fragment=step // 10 % 2, pseudo_grad_norm=0.5,
                       weight=0.5, anomaly=False, outer_lr=0.7)
        time.sleep(0.02)
    for w in writers:
        w.emit("run", phase="end", world=2, config_hash="live-test")
        w.close()
    write_json_atomic(rd.summary, {"algorithm": "streaming", "replicas": 2, "shards": 1,
                                   "steps": step, "tokens": 512 * step, "final_loss": 2.0})
""")


class Kernel:
    """A python3 kernel and a blocking client; run() executes code and returns its stdout."""

    def __init__(self, cwd):
        self.km = jupyter_client.KernelManager(kernel_name="python3")
        # the kernelspec runs `python`: make it this interpreter, venv activated or not
        path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
        self.km.start_kernel(cwd=str(cwd), env={**os.environ, "PATH": path})
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def run(self, code: str, timeout: float = 60) -> tuple[str, list[dict]]:
        out, msgs = [], []

        def hook(msg):
            msgs.append(msg)
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])

        reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=hook,
                                            allow_stdin=False)
        assert reply["content"]["status"] == "ok", "\n".join(reply["content"].get("traceback", []))
        return "".join(out), msgs

    def value(self, expr: str):
        return json.loads(self.run(f"import json as _j; print(_j.dumps({expr}))")[0])

    def widget_updates(self, seconds: float) -> int:
        """Widget state updates the kernel sent on iopub during `seconds` (what a frontend gets)."""
        n, end = 0, time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            try:
                msg = self.kc.get_iopub_msg(timeout=left)
            except queue.Empty:
                break
            if msg["msg_type"] == "comm_msg" and msg["content"]["data"].get("method") == "update":
                n += 1
        return n

    def close(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def test_dashboard_updates_live_in_a_kernel(tmp_path):
    rd = RunDir(tmp_path / "run").create()
    write_json_atomic(rd.config, {"name": "live", "algo": "streaming", "replicas": 2,
                                  "shards": 1, "steps": 3000, "link_bandwidth": "100Mbit"})
    stop = tmp_path / "stop"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(rd.root), str(stop)])
    kernel = None
    try:
        kernel = Kernel(tmp_path)
        # imports and plotly's one-time set-up (about 2 s) out of the timing
        kernel.run("from lowband.dashboard import Dashboard\n"
                   "import plotly.graph_objects as go\n_ = go.FigureWidget()")

        began = time.monotonic()
        _, msgs = kernel.run(f"d = Dashboard({str(rd.root)!r}, interval=0.2)\nd")
        took = time.monotonic() - began
        # the cell returned at once: the writer goes on for up to a minute, and the view is live
        assert took < 10, f"displaying the dashboard took {took:.1f} s"  # (about 1 s here)
        assert writer.poll() is None, "the writer ended before the dashboard was shown"
        views = [m for m in msgs if m["msg_type"] in ("display_data", "execute_result")
                 and "application/vnd.jupyter.widget-view+json" in m["content"]["data"]]
        assert views, "no widget view was displayed"
        assert kernel.value("d.live") is True

        points = "sum(len(t.x) for t in d.loss_fig.data if 'replica' in (t.name or ''))"
        updates_1 = kernel.widget_updates(1.5)
        first = kernel.value(f"[{points}, d.renders]")
        updates_2 = kernel.widget_updates(1.5)
        second = kernel.value(f"[{points}, d.renders]")
        assert 0 < first[0] < second[0], (first, second)       # the loss lines grew
        assert first[1] < second[1], (first, second)           # it redrew in between
        assert updates_1 > 0 and updates_2 > 0, (updates_1, updates_2)
        bars = kernel.value("sum(len(t.x) for t in d.timeline_fig.data if t.type == 'bar')")
        assert bars > 0
        # the "no events yet" notes of the empty figures went once data came
        notes = kernel.value("[len(f.layout.annotations) for f in "
                             "(d.loss_fig, d.bandwidth_fig, d.timeline_fig)]")
        assert notes == [0, 0, 0], notes

        stop.touch()                       # the writer finishes: run end, then summary.json
        writer.wait(timeout=30)
        deadline = time.monotonic() + 15
        while kernel.value("d.live") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert kernel.value("d.live") is False, "the dashboard still polls a finished run"
        final = kernel.value(f"[{points}, d.models[0].stats()['status']]")
        assert final[1] == "finished" and final[0] >= second[0], final
    finally:
        stop.touch()
        if writer.poll() is None:
            writer.kill()
            writer.wait()
        if kernel is not None:
            kernel.close()
