"""The live JupyterLab dashboard: Dashboard, ipywidgets around plotly FigureWidgets fed by
RunModels.

Dashboard is made of three parts: panels.py (its widgets and drawing into them), live.py
(polling) and this module: building it, its launch handles (their status, Start and Stop) and
the export of its runs as an offline report.
"""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path

import ipywidgets as W

from .export import write_report
from .live import Polling, in_kernel, running_loop
from .model import RunModel
from .panels import Panels
from .style import XAXES

HANDLE_STATUS_EVERY_S = 5.0
# a launch handle in one of these states ended its run, whether or not summary.json was written
# (LaunchHandle.status() says them in lower case; other handles may not)
HANDLE_ENDED = ("failed", "cancelled")


class Dashboard(Panels, Polling):
    """Live view of one run, or of several overlaid for comparison.

    run: a run directory (str or Path), a launch handle (any object with `.run_dir`, and
    optionally `.start()`, `.cancel()`, `.status()`), or a list of these.

    Displaying it (last expression of a cell, or display(d)) returns at once. Inside a kernel
    it polls by itself: an asyncio task on the kernel's loop reads new events in a worker
    thread and updates the figures at most every `interval` seconds, and stops once every run
    is over: it has its summary.json, or its handle's status is failed or cancelled (asked at
    most every HANDLE_STATUS_EVERY_S). Outside a kernel it loads once; call refresh() or start().
    """

    def __init__(self, run, *, interval: float = 0.25, window_s: float = 30.0,
                 xaxis: str | None = None, spike_z: float = 5.0, spike_alpha: float = 0.05,
                 spike_warmup: int = 20, max_points: int = 2000, max_spans: int = 3000,
                 autostart: bool = True):
        sources = list(run) if isinstance(run, (list, tuple)) else [run]
        if not sources:
            raise ValueError("Dashboard needs a run directory, a launch handle or a list of them.")
        if xaxis is not None and xaxis not in XAXES:
            raise ValueError(f"xaxis must be one of {', '.join(XAXES)}, not {xaxis!r}.")
        is_handle = [not isinstance(s, (str, os.PathLike)) for s in sources]
        self.handles = [s for s, h in zip(sources, is_handle) if h]
        # per run: the index of its handle in self.handles, or None for a run directory
        self._handle_of = [sum(is_handle[:k]) if h else None for k, h in enumerate(is_handle)]
        self._handle_status: list[str] = [""] * len(self.handles)
        self._handle_checked = -math.inf
        self._ended: set[int] = set()      # runs whose handle says failed or cancelled
        self.models = [RunModel(s, spike_z=spike_z, spike_alpha=spike_alpha,
                                spike_warmup=spike_warmup) for s in sources]
        self.max_points, self.max_spans = max_points, max_spans
        self._setup_polling(interval)
        self._build(xaxis, window_s, self._launch_buttons())
        if autostart:
            if running_loop() is not None or in_kernel():
                self.start()        # the first load happens off the kernel's thread
            else:
                self.refresh()

    # -- launch handles ------------------------------------------------------------------------

    def _launch_buttons(self) -> list:
        """Start and Stop buttons, for handles that can start or cancel their job."""
        self.start_button = self.stop_button = None
        if any(callable(getattr(h, "start", None)) for h in self.handles):
            self.start_button = W.Button(description="Start", icon="play", button_style="success",
                                         layout=W.Layout(width="85px"))
            self.start_button.on_click(lambda _: self._call_handles("start"))
        if any(callable(getattr(h, "cancel", None)) for h in self.handles):
            self.stop_button = W.Button(description="Stop", icon="stop", button_style="danger",
                                        layout=W.Layout(width="85px"))
            self.stop_button.on_click(lambda _: self._call_handles("cancel"))
        return [b for b in (self.start_button, self.stop_button) if b is not None]

    def _check_handles(self) -> set[int]:
        """Ask the handles for their status, at most every HANDLE_STATUS_EVERY_S; returns the
        runs found ended (failed or cancelled) by this call."""
        now = time.monotonic()
        if not self.handles or now - self._handle_checked < HANDLE_STATUS_EVERY_S:
            return set()
        self._handle_checked = now
        for i, h in enumerate(self.handles):
            status = getattr(h, "status", None)
            if callable(status):
                try:
                    self._handle_status[i] = _short(status())
                except Exception as e:      # a launcher failing must not stop drawing
                    self._handle_status[i] = f"status failed: {e}"
        ended = {k for k in range(len(self.models))
                 if self._job_status(k).lower() in HANDLE_ENDED}
        newly, self._ended = ended - self._ended, ended
        return newly

    def _job_status(self, k: int) -> str:
        """What run k's handle last said of its status ("" for a run directory)."""
        i = self._handle_of[k]
        return self._handle_status[i] if i is not None else ""

    def _statuses(self, stats: list[dict]) -> tuple[list[dict], list[str]]:
        """Each run's status as the summary shows it, and the note beside it: a run whose job
        failed or was cancelled before writing summary.json shows that final state; otherwise
        the run's own status, with its job's status beside it when that says something more."""
        shown, notes = [], []
        for k, s in enumerate(stats):
            job, own = self._job_status(k), str(s.get("status"))
            if k in self._ended and not self.models[k].finished:
                s, note = {**s, "status": job.lower()}, "ended without summary.json"
            elif not job or job.lower() == own or (own, job.lower()) == ("finished", "succeeded"):
                note = ""
            else:
                note = f"job {job}"
            shown.append(s)
            notes.append(note)
        return shown, notes

    def _call_handles(self, method: str) -> None:
        def run():
            for h in self.handles:
                fn = getattr(h, method, None)
                if callable(fn):
                    try:
                        fn()
                    except Exception as e:
                        self.show_error(f"{method} failed: {e}")
            self._handle_checked = -math.inf     # show what the call changed at the next poll
            if method == "start":
                self.start()
        threading.Thread(target=run, daemon=True, name=f"lowband-dashboard-{method}").start()

    # -- export --------------------------------------------------------------------------------

    @property
    def run_dirs(self) -> list[Path]:
        return [m.run_dir for m in self.models if m.run_dir is not None]

    def export_html(self, path, **kwargs) -> Path:
        """Write the offline HTML report of these runs (see lowband.report.write_report)."""
        return write_report(self.run_dirs, path, **kwargs)


def _short(status) -> str:
    if status is None:
        return ""
    for attr in ("state", "status", "name"):
        v = getattr(status, attr, None)
        if isinstance(v, str):
            return v
        if v is not None and hasattr(v, "name"):
            return str(v.name)
    text = str(status)
    return text if len(text) < 60 else text[:57] + "..."
