"""Specs to plotly: a go.Figure for the report, a go.FigureWidget for the dashboard, and the
in-place update that swaps a new spec's data into a widget.

A spec is (traces, layout), plain dicts (style.Spec). The builders always give the same traces
in the same order for the same runs, so a live update usually only swaps data.
"""

from __future__ import annotations

import numpy as np

from .style import Spec

NUMERIC = ("x", "y", "base")


def _arrays(trace: dict) -> dict:
    """Numeric lists as float arrays (None -> NaN, a gap): plotly validates those in one go
    and a FigureWidget sends them to the browser as binary buffers."""
    out = dict(trace)
    for key in NUMERIC:
        v = out.get(key)
        if isinstance(v, list):
            try:
                out[key] = np.array([np.nan if e is None else e for e in v], dtype=float)
            except (TypeError, ValueError):
                pass
    return out


def make_figure(spec: Spec, widget: bool = False):
    import plotly.graph_objects as go
    traces, layout = spec
    cls = go.FigureWidget if widget else go.Figure
    return cls(data=[_arrays(t) for t in traces], layout=layout)


def trace_signature(traces) -> list[tuple]:
    return [(t.get("type", "scatter"), t.get("name")) for t in traces]


def update_figure(fig, spec: Spec, layout: bool = True) -> None:
    """Swap a figure's data for a new spec's, in one batched update. When the set of traces is
    the same (the usual case) only their properties change; otherwise they are replaced."""
    traces, lay = spec
    with fig.batch_update():
        if trace_signature(traces) == [(t.type, t.name) for t in fig.data]:
            for old, new in zip(fig.data, traces, strict=True):
                old.update({k: v for k, v in _arrays(new).items() if k != "type"})
        else:
            fig.data = ()
            fig.add_traces([_arrays(t) for t in traces])
        if layout:
            # the template was set when the figure was made; re-applying it costs ~10-20 ms
            fig.layout.update({k: v for k, v in lay.items() if k != "template"})
            # update() merges lists element by element: an empty list would keep old notes
            fig.layout.annotations = lay.get("annotations", ())
