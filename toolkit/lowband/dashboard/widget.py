"""The live JupyterLab dashboard: ipywidgets around plotly FigureWidgets, fed by RunModels."""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time
from pathlib import Path

import ipywidgets as W

from . import figures as F
from .model import RunModel

HANDLE_STATUS_EVERY_S = 5.0
# a launch handle in one of these states ended its run, whether or not summary.json was written
# (LaunchHandle.status() says them in lower case; other handles may not)
HANDLE_ENDED = ("failed", "cancelled")
# polling and redrawing take at most this share of one core: after a cycle that used c seconds
# of CPU, the next starts at least c * (1 / BUSY_SHARE - 1) later (benchmarks/dashboard_load.py)
BUSY_SHARE = 0.15


def _running_loop():
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


class Dashboard:
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
                 xaxis: str = "step", spike_z: float = 5.0, spike_alpha: float = 0.05,
                 spike_warmup: int = 20, max_points: int = 2000, max_spans: int = 3000,
                 autostart: bool = True):
        sources = list(run) if isinstance(run, (list, tuple)) else [run]
        if not sources:
            raise ValueError("Dashboard needs a run directory, a launch handle or a list of them.")
        if xaxis not in F.XAXES:
            raise ValueError(f"xaxis must be one of {', '.join(F.XAXES)}, not {xaxis!r}.")
        is_handle = [not isinstance(s, (str, os.PathLike)) for s in sources]
        self.handles = [s for s, h in zip(sources, is_handle) if h]
        # per run: the index of its handle in self.handles, or None for a run directory
        self._handle_of = [sum(is_handle[:k]) if h else None for k, h in enumerate(is_handle)]
        self.models = [RunModel(s, spike_z=spike_z, spike_alpha=spike_alpha,
                                spike_warmup=spike_warmup) for s in sources]
        self.interval = interval
        self.max_points, self.max_spans = max_points, max_spans
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._task: asyncio.Task | None = None
        self._thread: threading.Thread | None = None
        self._rendered: tuple | None = None
        self._setting_range = False
        self._set_range = None
        self._handle_status: list[str] = [""] * len(self.handles)
        self._handle_checked = -math.inf
        self._ended: set[int] = set()      # runs whose handle says failed or cancelled
        self.renders = 0
        self.last_error: str | None = None
        self._build(xaxis, window_s)
        if autostart:
            if _running_loop() is not None or _in_kernel():
                self.start()        # the first load happens off the kernel's thread
            else:
                self.refresh()

    # -- widgets -------------------------------------------------------------------------------

    def _build(self, xaxis: str, window_s: float) -> None:
        self.loss_fig = F.make_figure(F.loss_spec([], xaxis), widget=True)
        self.loss_fig.layout.height = 380
        self.bandwidth_fig = F.make_figure(F.bandwidth_spec([]), widget=True)
        self.bandwidth_fig.layout.height = 300
        self.timeline_fig = F.make_figure(F.timeline_spec(self.models[0]), widget=True)
        self.timeline_fig.layout.on_change(self._on_timeline_zoom, "xaxis.range")

        self.xaxis = W.ToggleButtons(options=[("step", "step"), ("tokens", "tokens"),
                                              ("wall time", "time")], value=xaxis,
                                     description="loss vs", style={"button_width": "80px"})
        self.window = W.BoundedFloatText(value=window_s, min=0.5, max=1e7, step=5,
                                         description="window (s)",
                                         layout=W.Layout(width="170px"))
        self.follow = W.Checkbox(value=True, description="follow latest", indent=False,
                                 layout=W.Layout(width="120px"))
        self.timeline_run = W.Dropdown(options=[(m.name, i) for i, m in enumerate(self.models)],
                                       value=0, description="timeline",
                                       layout=W.Layout(width="260px",
                                                       display="" if len(self.models) > 1
                                                       else "none"))
        self.refresh_button = W.Button(description="refresh", icon="refresh",
                                       layout=W.Layout(width="95px"))
        self.refresh_button.on_click(lambda _: self.refresh())
        buttons = [self.refresh_button]
        self.start_button = self.stop_button = None
        if any(callable(getattr(h, "start", None)) for h in self.handles):
            self.start_button = W.Button(description="Start", icon="play", button_style="success",
                                         layout=W.Layout(width="85px"))
            self.start_button.on_click(lambda _: self._call_handles("start"))
            buttons.append(self.start_button)
        if any(callable(getattr(h, "cancel", None)) for h in self.handles):
            self.stop_button = W.Button(description="Stop", icon="stop", button_style="danger",
                                        layout=W.Layout(width="85px"))
            self.stop_button.on_click(lambda _: self._call_handles("cancel"))
            buttons.append(self.stop_button)
        for w in (self.xaxis, self.window, self.follow, self.timeline_run):
            w.observe(lambda _: self._render(force=True), names="value")

        self.title = W.HTML()
        self.summary = W.HTML()
        self.message = W.HTML()
        controls = W.HBox([self.xaxis, *buttons], layout=W.Layout(flex_flow="row wrap",
                                                                  align_items="center"))
        tl_controls = W.HBox([self.timeline_run, self.window, self.follow],
                             layout=W.Layout(align_items="center"))
        self.widget = W.VBox([self.title, self.summary, controls, self.loss_fig,
                              self.bandwidth_fig, tl_controls, self.timeline_fig, self.message],
                             layout=W.Layout(width="100%"))
        self._update_title()

    def _ipython_display_(self, **kwargs):
        from IPython.display import display
        display(self.widget)

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def display(self):
        """Show the dashboard (same as making it the last expression of a cell)."""
        from IPython.display import display
        display(self.widget)
        return self

    # -- polling and drawing -------------------------------------------------------------------

    def _poll(self) -> int:
        with self._lock:
            # the handles first: a run seen ending here is then read to its last event
            ended = self._check_handles()
            new = 0
            for k, m in enumerate(self.models):
                seen = m.events_seen
                if k in ended:
                    m.load()    # no summary.json will come: close the steps still pending
                else:
                    m.poll()
                new += m.events_seen - seen
            return new

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

    def refresh(self) -> int:
        """Read what is new in every run and redraw (synchronously). Returns how many events
        were new."""
        new = self._poll()
        self._render()
        return new

    def _render(self, force: bool = False) -> None:
        with self._lock:
            try:
                self._draw(force)
            except Exception as e:   # show it, keep polling: a bad event must not kill the view
                self.last_error = f"{type(e).__name__}: {e}"
                self.message.value = (f"<span style='color:#d62728'>dashboard error: "
                                      f"{_esc(self.last_error)}</span>")

    def _draw(self, force: bool) -> None:
        models = self.models
        stats, extra = self._statuses([m.stats() for m in models])
        self.summary.value = F.summary_html(stats, extra)
        self._update_title()
        options = [(m.name, i) for i, m in enumerate(models)]
        if list(self.timeline_run.options) != options:   # names known once configs are read
            value = self.timeline_run.value
            with self.timeline_run.hold_trait_notifications():
                self.timeline_run.options = options
                self.timeline_run.value = value
        key = (tuple(m.version for m in models), self.xaxis.value, self.window.value,
               self.follow.value, self.timeline_run.value)
        if key == self._rendered and not force:
            return
        self._rendered = key
        F.update_figure(self.loss_fig, F.loss_spec(models, self.xaxis.value, self.max_points))
        F.update_figure(self.bandwidth_fig, F.bandwidth_spec(models))
        tl = models[self.timeline_run.value or 0]
        spec = F.timeline_spec(tl, self.window.value, max_spans=self.max_spans,
                               follow=self.follow.value)
        self._set_range = spec[1]["xaxis"].get("range")
        self._setting_range = True
        try:
            F.update_figure(self.timeline_fig, spec)
        finally:
            self._setting_range = False
        self.renders += 1
        if self.last_error:
            self.last_error = None
            self.message.value = ""

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

    def _update_title(self, live: bool | None = None) -> None:
        names = ", ".join(_esc(m.name) for m in self.models)
        ended = [f"{m.name} {self._job_status(k).lower()}" for k, m in enumerate(self.models)
                 if k in self._ended and not m.finished]
        live = self.live if live is None else live
        state = (f"polling every {self.interval:g} s" if live else
                 "not polling" if not self._done() else
                 f"all runs ended: {_esc(', '.join(ended))}" if ended else "all runs finished")
        self.title.value = (f"<div style='font-family:sans-serif'><b style='font-size:16px'>"
                            f"lowband · {names}</b> <span style='color:#888;font-size:12px'>"
                            f"{state}</span></div>")

    def _on_timeline_zoom(self, layout, xrange):
        if self._setting_range or not self.follow.value or not xrange:
            return
        mine = self._set_range
        if mine and all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for a, b in zip(xrange, mine)):
            return   # the browser echoing the range we set
        self.follow.value = False   # the user zoomed or panned: stop dragging the view along

    def _call_handles(self, method: str) -> None:
        def run():
            for h in self.handles:
                fn = getattr(h, method, None)
                if callable(fn):
                    try:
                        fn()
                    except Exception as e:
                        self.message.value = (f"<span style='color:#d62728'>{method} failed: "
                                              f"{_esc(str(e))}</span>")
            self._handle_checked = -math.inf     # show what the call changed at the next poll
            if method == "start":
                self.start()
        threading.Thread(target=run, daemon=True, name=f"lowband-dashboard-{method}").start()

    # -- live updates --------------------------------------------------------------------------

    @property
    def live(self) -> bool:
        return ((self._task is not None and not self._task.done())
                or (self._thread is not None and self._thread.is_alive()))

    def start(self) -> "Dashboard":
        """Poll and redraw every `interval` seconds until stop() or every run is over (see the
        class docstring): as an asyncio task when an event loop runs in this thread (a kernel),
        else in a thread."""
        if self.live:
            return self
        self._stop.clear()
        loop = _running_loop()
        if loop is not None:
            self._task = loop.create_task(self._run_async())
        else:
            self._thread = threading.Thread(target=self._run_thread, daemon=True,
                                            name="lowband-dashboard")
            self._thread.start()
        self._update_title()
        return self

    def stop(self) -> "Dashboard":
        """Stop polling (the figures keep what they show; start() resumes)."""
        self._stop.set()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._task = self._thread = None
        self._update_title()
        return self

    def _done(self) -> bool:
        """Every run is over: it has its summary.json, or its handle said failed or cancelled."""
        return all(m.finished or k in self._ended for k, m in enumerate(self.models))

    async def _run_async(self) -> None:
        try:
            while not self._stop.is_set():
                began = time.process_time()
                new = await asyncio.to_thread(self._poll)
                self._render(force=bool(new))
                if self._done():
                    break
                await asyncio.sleep(max(self.interval, _pause(time.process_time() - began)))
        except asyncio.CancelledError:
            pass
        finally:
            self._task = None
            self._update_title()

    def _run_thread(self) -> None:
        try:
            while not self._stop.is_set():
                began = time.process_time()
                new = self._poll()
                self._render(force=bool(new))
                if self._done():
                    break
                self._stop.wait(max(self.interval, _pause(time.process_time() - began)))
        finally:
            self._update_title(live=False)    # this thread is still alive: not self.live

    # -- export --------------------------------------------------------------------------------

    @property
    def run_dirs(self) -> list[Path]:
        return [m.run_dir for m in self.models if m.run_dir is not None]

    def export_html(self, path, **kwargs) -> Path:
        """Write the offline HTML report of these runs (see lowband.report.write_report)."""
        from lowband.report import write_report
        return write_report(self.run_dirs, path, **kwargs)


def _pause(cpu_s: float) -> float:
    return cpu_s * (1 / BUSY_SHARE - 1)


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


def _esc(s: str) -> str:
    import html
    return html.escape(s)
