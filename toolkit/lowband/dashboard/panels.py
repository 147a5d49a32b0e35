"""The dashboard's layout: its widgets (title, summary, each replica's work, controls, the
three FigureWidgets) and drawing the runs' models into them."""

from __future__ import annotations

import html

import ipywidgets as W

from .bandwidth_figure import bandwidth_spec
from .loss_figure import loss_spec
from .loss_figure import opening_xaxis
from .replicas import replicas_table
from .specs import make_figure, update_figure
from .style import XAXIS_BUTTONS
from .tables import summary_html
from .timeline_figure import timeline_spec


class Panels:
    """Dashboard's widgets and drawing (a mixin: reads models, interval, max_points, max_spans,
    _lock, _ended, live; calls refresh, _statuses, _job_status and _done)."""

    def _build(self, xaxis: str | None, window_s: float, buttons: list) -> None:
        """Make the widgets; `buttons` go beside the refresh button (Start, Stop). xaxis None:
        the loss figure's x axis is chosen once every run's config is read (opening_xaxis)."""
        self._pick_xaxis = xaxis is None
        self._rendered: tuple | None = None     # what the figures show: see _draw
        self._setting_range = False
        self._set_range = None
        self.renders = 0
        self.last_error: str | None = None
        xaxis = xaxis or "step"
        self.loss_fig = make_figure(loss_spec([], xaxis), widget=True)
        self.loss_fig.layout.height = 380
        self.bandwidth_fig = make_figure(bandwidth_spec([]), widget=True)
        self.bandwidth_fig.layout.height = 300
        self.timeline_fig = make_figure(timeline_spec(self.models[0]), widget=True)
        self.timeline_fig.layout.on_change(self._on_timeline_zoom, "xaxis.range")

        self.xaxis = W.ToggleButtons(options=[(label, ax) for ax, label in XAXIS_BUTTONS.items()],
                                     value=xaxis,
                                     description="loss vs", style={"button_width": "90px"})
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
        for w in (self.xaxis, self.window, self.follow, self.timeline_run):
            w.observe(lambda _: self._render(force=True), names="value")

        self.title = W.HTML()
        self.summary = W.HTML()
        self.replicas = W.HTML()      # each replica's work (runs of two replicas or more)
        self.message = W.HTML()
        controls = W.HBox([self.xaxis, self.refresh_button, *buttons],
                          layout=W.Layout(flex_flow="row wrap", align_items="center"))
        tl_controls = W.HBox([self.timeline_run, self.window, self.follow],
                             layout=W.Layout(align_items="center"))
        self.widget = W.VBox([self.title, self.summary, self.replicas, controls, self.loss_fig,
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

    def show_error(self, text: str) -> None:
        self.message.value = f"<span style='color:#d62728'>{html.escape(text)}</span>"

    def _render(self, force: bool = False) -> None:
        with self._lock:
            try:
                self._draw(force)
            except Exception as e:   # show it, keep polling: a bad event must not kill the view
                self.last_error = f"{type(e).__name__}: {e}"
                self.show_error(f"dashboard error: {self.last_error}")

    def _draw(self, force: bool) -> None:
        models = self.models
        stats, extra = self._statuses([m.stats() for m in models])
        self.summary.value = summary_html(stats, extra)
        self.replicas.value = replicas_table(models)
        self._update_title()
        options = [(m.name, i) for i, m in enumerate(models)]
        if list(self.timeline_run.options) != options:   # names known once configs are read
            value = self.timeline_run.value
            with self.timeline_run.hold_trait_notifications():
                self.timeline_run.options = options
                self.timeline_run.value = value
        if self._pick_xaxis and all(m.config for m in models):  # once: the user's choice stays
            self._pick_xaxis = False
            self.xaxis.value = opening_xaxis(models)      # a change draws, by its observer
        key = (tuple(m.version for m in models), self.xaxis.value, self.window.value,
               self.follow.value, self.timeline_run.value)
        if key == self._rendered and not force:
            return
        self._rendered = key
        update_figure(self.loss_fig, loss_spec(models, self.xaxis.value, self.max_points))
        update_figure(self.bandwidth_fig, bandwidth_spec(models))
        tl = models[self.timeline_run.value or 0]
        spec = timeline_spec(tl, self.window.value, max_spans=self.max_spans,
                             follow=self.follow.value)
        self._set_range = spec[1]["xaxis"].get("range")
        self._setting_range = True
        try:
            update_figure(self.timeline_fig, spec)
        finally:
            self._setting_range = False
        self.renders += 1
        if self.last_error:
            self.last_error = None
            self.message.value = ""

    def _update_title(self, live: bool | None = None) -> None:
        names = ", ".join(html.escape(m.name) for m in self.models)
        ended = [f"{m.name} {self._job_status(k).lower()}" for k, m in enumerate(self.models)
                 if k in self._ended and not m.finished]
        live = self.live if live is None else live
        state = (f"polling every {self.interval:g} s" if live else
                 "not polling" if not self._done() else
                 f"all runs ended: {html.escape(', '.join(ended))}" if ended
                 else "all runs finished")
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
