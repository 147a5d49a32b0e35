"""Plotly figures of runs, shared by the live dashboard and the static report.

Each builder returns a spec, (traces, layout): plain dicts that make a go.Figure for the report
(make_figure) or update a go.FigureWidget in place for the dashboard (update_figure). The same
models always give the same traces in the same order, so a live update only swaps data.
"""

from __future__ import annotations

import html
import math

import numpy as np

from lowband.units import fmt_si

from .model import RunModel
from .records import _natural

PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf"]
FRAGMENT_PALETTE = ["#4e79a7", "#e15759", "#59a14f", "#b07aa1", "#edc948", "#76b7b2",
                    "#ff9da7", "#9c755f", "#f28e2b", "#bab0ac"]
DASHES = ["solid", "dot", "dash", "dashdot", "longdash", "longdashdot"]
COMPUTE_COLOR = "rgba(110,140,190,0.35)"
INNER_COLOR = "#f0a04b"
ANOMALY_COLOR = "#d62728"
XAXES = {"step": "step", "tokens": "tokens (whole run)", "time": "wall time (s)"}
MAX_TAGS = 10

Spec = tuple[list[dict], dict]


# -- formatting -------------------------------------------------------------------------------

def fmt_bytes(x) -> str:
    return fmt_si(x, "B")


def fmt_rate(x) -> str:
    return fmt_si(x, "B/s")


def fmt_bits(bytes_per_s) -> str:
    return fmt_si(None if bytes_per_s is None else bytes_per_s * 8, "bit/s")


def fmt_value(key: str, v) -> str:
    """A stats or summary value for a table cell."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if isinstance(v, float) and not math.isfinite(v):
            return "–"
        if key.endswith("bytes_per_s") or key.endswith("_per_s") and "bytes" in key:
            return fmt_rate(v)
        if key.endswith("bytes") or key == "bytes_per_token":
            return fmt_bytes(v)
        if key == "compute_utilization":
            return f"{100 * v:.1f} %"
        if key.endswith("loss"):
            return f"{v:.4f}"
        if key.endswith("_s") and not key.endswith("_per_s"):
            return f"{v:.3g} s" if v < 10 else f"{v:,.1f} s"
        if isinstance(v, int) or float(v).is_integer():
            return f"{int(v):,}"
        return fmt_si(v)
    return str(v)


# -- helpers ----------------------------------------------------------------------------------

def downsample(n: int, max_points: int) -> np.ndarray:
    """Indices of at most max_points evenly strided points, always keeping the last one."""
    if n <= max_points:
        return np.arange(n)
    idx = np.linspace(0, n - 1, max_points).round().astype(int)
    return np.unique(idx)


def _x(model: RunModel, xaxis: str, step, t, replica_tokens):
    if xaxis == "tokens":
        return None if replica_tokens is None else model.run_tokens(replica_tokens)
    if xaxis == "time":
        return None if t is None else t - (model.t0 or 0.0)
    return step


def fragment_colors(tags) -> dict[str, str]:
    ordered = sorted(set(tags), key=_natural)
    return {tag: FRAGMENT_PALETTE[i % len(FRAGMENT_PALETTE)] for i, tag in enumerate(ordered)}


def _empty_note(text: str) -> dict:
    return dict(text=text, xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False,
                font=dict(color="#888", size=14))


BASE_LAYOUT = dict(template="plotly_white", margin=dict(l=60, r=20, t=40, b=45),
                   legend=dict(font=dict(size=11)), uirevision="lowband")


# -- loss -------------------------------------------------------------------------------------

def loss_spec(models: list[RunModel], xaxis: str = "step", max_points: int = 2000,
              max_marks: int = 500) -> Spec:
    """Loss per replica (mean over its ranks), validation loss, spikes and outer syncs."""
    multi = len(models) > 1
    traces: list[dict] = []
    for ri, m in enumerate(models):
        run_color = PALETTE[ri % len(PALETTE)]
        prefix = f"{m.name} · " if multi else ""
        group = m.name if multi else None
        for k, rep in enumerate(sorted(m.replicas)):
            rs = m.replicas[rep]
            idx = downsample(len(rs.steps), max_points)
            xs = [_x(m, xaxis, rs.steps[i], rs.t[i], rs.tokens[i]) for i in idx]
            traces.append(dict(
                type="scatter", mode="lines", name=f"{prefix}replica {rep}",
                x=xs, y=[rs.loss[i] for i in idx], legendgroup=group,
                line=dict(color=run_color if multi else PALETTE[k % len(PALETTE)],
                          dash=DASHES[k % len(DASHES)] if multi else "solid", width=1.5)))
        vsteps, vals, vts, vtoks = m.val_series()
        traces.append(dict(
            type="scatter", mode="lines+markers", name=f"{prefix}val loss",
            x=(vtoks if xaxis == "tokens" else
               [t - (m.t0 or 0.0) for t in vts] if xaxis == "time" else vsteps),
            y=vals, legendgroup=group,
            line=dict(color=run_color if multi else "#222", width=2),
            marker=dict(size=6, symbol="circle")))
        spikes = m.detected_spikes()[-max_marks:]
        z = m.spike_params[0]
        traces.append(dict(
            type="scatter", mode="markers", name=f"{prefix}loss spike (z>{z:g})",
            x=[_x(m, xaxis, s.step, s.t, s.tokens) for s in spikes], y=[s.loss for s in spikes],
            text=[f"replica {s.replica} step {s.step}: z={s.z:.1f}" for s in spikes],
            legendgroup=group,
            marker=dict(symbol="x", size=11, color=ANOMALY_COLOR, line=dict(width=1))))
        ev = m.spike_events[-max_marks:]
        traces.append(dict(
            type="scatter", mode="markers", name=f"{prefix}spike events",
            x=[_x(m, xaxis, s.step, s.t, _tokens_at(m, s.replica, s.step)) for s in ev],
            y=[s.loss for s in ev], legendgroup=group,
            text=[f"trainer spike, replica {s.replica} step {s.step}: z={s.z:.1f}" for s in ev],
            marker=dict(symbol="star", size=11, color="#ff7f0e", line=dict(width=1)),
            visible=True if ev else "legendonly"))
        marks = m.sync_marks()[-max_marks:]
        sx, sy, stext = [], [], []
        ax, atext = [], []
        for mk in marks:
            step = mk.step
            rs = m.replicas.get(mk.replica)
            if step is None and rs is not None:
                step = rs.step_at(mk.t)
            tok = rs.tokens_at(step) if (rs is not None and step is not None) else None
            x = _x(m, xaxis, step, mk.t, tok)
            if x is None:
                continue
            label = f"outer sync {mk.label}" + (f" step {step}" if step is not None else "")
            sx += [x, x, None]
            sy += [0, 1, None]
            stext += [label, label, None]
            if mk.anomaly:
                ax.append(x)
                atext.append(f"anomaly: {mk.label} step {step}")
        traces.append(dict(
            type="scatter", mode="lines", name=f"{prefix}outer sync", x=sx, y=sy, yaxis="y2",
            text=stext, hoverinfo="text", legendgroup=group,
            line=dict(color=run_color if multi else "#999", width=1), opacity=0.35))
        traces.append(dict(
            type="scatter", mode="markers", name=f"{prefix}anomalous sync", x=ax,
            y=[0.97] * len(ax), yaxis="y2", text=atext, hoverinfo="text", legendgroup=group,
            marker=dict(symbol="triangle-down", size=10, color=ANOMALY_COLOR),
            visible=True if ax else "legendonly"))
    layout = dict(BASE_LAYOUT, title=dict(text="loss", x=0.01, font=dict(size=15)),
                  xaxis=dict(title=dict(text=XAXES.get(xaxis, xaxis))),
                  yaxis=dict(title=dict(text="loss")),
                  yaxis2=dict(overlaying="y", range=[0, 1], visible=False, fixedrange=True),
                  annotations=[] if any(m.replicas for m in models)
                  else [_empty_note("no step events yet")])
    return traces, layout


def _tokens_at(m: RunModel, replica: int, step: int):
    rs = m.replicas.get(replica)
    return rs.tokens_at(step) if rs is not None else None


def loss_figure_static(models: list[RunModel], max_points: int = 2000):
    """The loss figure with buttons that switch the x axis (step, tokens, wall time) in the
    browser: every axis's x data is embedded, nothing needs a kernel."""
    import plotly.graph_objects as go
    specs = {ax: loss_spec(models, ax, max_points) for ax in XAXES}
    fig = make_figure(specs["step"])
    buttons = [dict(label=ax if ax != "time" else "wall time", method="update",
                    args=[{"x": [t["x"] for t in specs[ax][0]]},
                          {"xaxis.title.text": XAXES[ax], "xaxis.autorange": True}])
               for ax in XAXES]
    fig.update_layout(updatemenus=[go.layout.Updatemenu(
        type="buttons", direction="right", buttons=buttons, showactive=True, active=0,
        x=1.0, xanchor="right", y=1.12, yanchor="bottom", pad=dict(r=0, t=0))],
        margin=dict(t=70))
    return fig


# -- outer-link bandwidth ---------------------------------------------------------------------

def bandwidth_spec(models: list[RunModel], max_bins: int = 300) -> Spec:
    """Bytes per second on the outer link over time, its mean and peak and the capacity."""
    multi = len(models) > 1
    traces: list[dict] = []
    capacities = {}
    any_data = False
    for ri, m in enumerate(models):
        if m.capacity():
            capacities.setdefault(m.capacity(), m.name)
        bw = m.bandwidth(max_bins=max_bins, by="total" if multi else "link")
        if not bw["series"]:
            continue
        any_data = True
        edges = bw["edges"]
        if multi:
            rate = bw["series"]["all links"] / max(bw["links"], 1)
            color = PALETTE[ri % len(PALETTE)]
            traces.append(dict(type="scatter", mode="lines", line_shape="hv",
                               name=f"{m.name} (mean per link)", legendgroup=m.name,
                               x=edges, y=np.append(rate, rate[-1]),
                               line=dict(color=color, width=1.5)))
            i = int(np.argmax(rate))
            traces.append(dict(type="scatter", mode="markers", legendgroup=m.name,
                               name=f"{m.name} peak {fmt_rate(rate[i])}",
                               x=[edges[i] + bw["width"] / 2], y=[rate[i]],
                               marker=dict(color=color, size=9, symbol="triangle-up")))
            continue
        for k, (key, rate) in enumerate(bw["series"].items()):
            traces.append(dict(type="scatter", mode="lines", line_shape="hv", name=key,
                               x=edges, y=np.append(rate, rate[-1]),
                               fill="tozeroy" if len(bw["series"]) == 1 else None,
                               line=dict(color=PALETTE[k % len(PALETTE)], width=1.5)))
        best_key = max(bw["series"], key=lambda k: bw["series"][k].max())
        rate = bw["series"][best_key]
        i = int(np.argmax(rate))
        traces.append(dict(type="scatter", mode="markers", name=f"peak {fmt_rate(rate[i])}",
                           x=[edges[i] + bw["width"] / 2], y=[rate[i]],
                           text=[f"peak {fmt_rate(rate[i])} ({best_key}, "
                                 f"{bw['width']:g} s bins)"], hoverinfo="text",
                           marker=dict(color="#333", size=9, symbol="triangle-up")))
        traces.append(dict(type="scatter", mode="lines", x=[edges[0], edges[-1]],
                           y=[bw["mean"], bw["mean"]],
                           name=f"mean {fmt_rate(bw['mean'])} (busiest link)",
                           line=dict(color="#333", dash="dash", width=1)))
    if any_data:
        x_end = max((float(t["x"][-1]) for t in traces if len(t["x"])), default=1.0)
        for cap, name in capacities.items():
            label = f"capacity {fmt_bits(cap)}" + (f" ({name})" if multi else "")
            traces.append(dict(type="scatter", mode="lines", x=[0, x_end], y=[cap, cap],
                               name=label, line=dict(color=ANOMALY_COLOR, dash="dot", width=1.5)))
    layout = dict(BASE_LAYOUT, title=dict(text="outer-link bandwidth", x=0.01,
                                          font=dict(size=15)),
                  xaxis=dict(title=dict(text="seconds since start")),
                  yaxis=dict(title=dict(text="bytes/s"), tickformat="~s", rangemode="tozero"),
                  annotations=[] if any_data else [_empty_note("no outer-link traffic yet")])
    return traces, layout


# -- sync timeline ----------------------------------------------------------------------------

def timeline_spec(model: RunModel, window_s: float | None = 30.0, keep_s: float | None = None,
                  max_spans: int = 3000, follow: bool = True) -> Spec:
    """One lane per rank: step windows (compute), inner and outer transfers and outer steps.

    Spans ending more than keep_s before the latest event are left out (all kept when None),
    then at most max_spans per trace, the latest. With follow, the x range shows the last
    window_s seconds.
    """
    t0 = model.t0 or 0.0
    t_hi = (model.t_last or t0) - t0
    if model.outer:
        t_hi = max(t_hi, max(x.end for x in model.outer[-200:]) - t0)
    cut = -math.inf if keep_s is None else t_hi - keep_s
    ranks = sorted(set(model.ranks) | {x.rank for x in model.outer[-1000:]}
                   | {x.rank for x in list(model.inner)[-1000:]})
    lane = {r: i for i, r in enumerate(ranks)}
    replica_of = {r: s.replica for r, s in model.ranks.items()}

    def recent(items, end_attr="end"):
        out = [x for x in items if getattr(x, end_attr) - t0 >= cut]
        return out[-max_spans:]

    traces: list[dict] = []
    steps = recent(model.steps)
    traces.append(dict(
        type="bar", orientation="h", name="step (compute)", width=0.8,
        base=[s.start - t0 for s in steps], x=[s.end - s.start for s in steps],
        y=[lane[s.rank] for s in steps],
        customdata=[f"rank {s.rank} step {s.step}: {s.end - s.start:.3f} s, "
                    f"compute {s.compute_s:.3f} s" for s in steps],
        hovertemplate="%{customdata}<extra></extra>", marker=dict(color=COMPUTE_COLOR)))
    inner = recent(model.inner)
    traces.append(dict(
        type="bar", orientation="h", name="inner comm", width=0.3,
        base=[x.start - t0 for x in inner], x=[x.end - x.start for x in inner],
        y=[lane[x.rank] + 0.22 for x in inner],
        customdata=[_transfer_text(x) for x in inner],
        hovertemplate="%{customdata}<extra></extra>", marker=dict(color=INNER_COLOR)))
    outer = recent(model.outer[-(max_spans * 4):])
    syncs = [s for s in model.syncs[-(max_spans * 2):] if s.t - t0 >= cut][-max_spans:]
    tags = sorted({x.tag for x in outer}, key=_natural)
    shown = tags[:MAX_TAGS]
    colors = fragment_colors(list(shown) + [s.label for s in syncs])
    for tag in shown + (["other"] if len(tags) > MAX_TAGS else []):
        group = [x for x in outer if (x.tag == tag if tag != "other" else x.tag not in shown)]
        traces.append(dict(
            type="bar", orientation="h", name=f"outer {tag or 'comm'}", width=0.3,
            base=[x.start - t0 for x in group], x=[x.end - x.start for x in group],
            y=[lane[x.rank] - 0.22 for x in group],
            customdata=[_transfer_text(x) for x in group],
            hovertemplate="%{customdata}<extra></extra>",
            marker=dict(color=colors.get(tag, "#555"))))
    ok = [s for s in syncs if not s.anomaly and s.rank in lane]
    bad = [s for s in syncs if s.anomaly and s.rank in lane]
    for name, group, symbol in (("outer step", ok, "diamond"), ("anomalous outer step", bad, "x")):
        traces.append(dict(
            type="scatter", mode="markers", name=name,
            x=[s.t - t0 for s in group], y=[lane[s.rank] - 0.22 for s in group],
            text=[_sync_text(s) for s in group], hoverinfo="text",
            marker=dict(symbol=symbol, size=9, line=dict(width=1, color="#222"),
                        color=[ANOMALY_COLOR if s.anomaly else colors.get(s.label, "#555")
                               for s in group]),
            visible=True if group or name == "outer step" else "legendonly"))
    xaxis = dict(title=dict(text="seconds since start"))
    if follow and window_s:
        lo = max(t_hi - window_s, 0.0)
        xaxis.update(range=[lo, t_hi + 0.02 * max(t_hi - lo, 1e-3)], autorange=False)
    n = max(len(ranks), 1)
    layout = dict(BASE_LAYOUT, barmode="overlay", height=min(120 + 46 * n, 760),
                  title=dict(text=f"sync timeline · {model.name}", x=0.01, font=dict(size=15)),
                  xaxis=xaxis,
                  yaxis=dict(tickvals=list(range(len(ranks))),
                             ticktext=[f"rank {r} (rep {replica_of.get(r, '?')})" for r in ranks],
                             autorange="reversed", showgrid=False, zeroline=False),
                  annotations=[] if ranks else [_empty_note("no events yet")])
    return traces, layout


def _transfer_text(x) -> str:
    text = (f"rank {x.rank} {x.op} {x.tag}: {fmt_bytes(x.wire_bytes)} on the wire "
            f"({fmt_bytes(x.payload_bytes)} payload{', ' + x.codec if x.codec else ''}) "
            f"in {x.end - x.start:.3f} s")
    return text + (f", {x.direction}" if x.direction else "")


def _sync_text(s) -> str:
    parts = [f"rank {s.rank} outer step {s.label}"]
    if s.step is not None:
        parts.append(f"step {s.step}")
    if s.norm is not None:
        parts.append(f"‖Δ‖={s.norm:.3g}")
    if s.weight is not None:
        parts.append(f"weight {s.weight:.3g}")
    if s.anomaly:
        parts.append("ANOMALY")
    return ", ".join(parts)


# -- figures from specs -----------------------------------------------------------------------

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


# -- summary ----------------------------------------------------------------------------------

SUMMARY_COLUMNS = [
    ("status", "status"), ("step", "step"), ("tokens_per_s", "tokens/s"),
    ("compute_utilization", "compute util."), ("bytes_per_token", "outer bytes/token"),
    ("peak_outer_bytes_per_s", "outer peak"), ("anomalies", "anomalies"), ("spikes", "spikes"),
    ("loss", "loss"), ("val_loss", "val loss"),
]
STATUS_COLORS = {"running": "#2ca02c", "finished": "#1f77b4", "stalled": "#d62728",
                 "waiting": "#888", "ended": "#1f77b4", "failed": "#d62728",
                 "cancelled": "#ff7f0e"}


def summary_html(stats: list[dict], extra: list[str] | None = None) -> str:
    """A compact table of headline numbers, one row per run (the dashboard's summary panel)."""
    head = "".join(f"<th>{html.escape(label)}</th>" for _, label in SUMMARY_COLUMNS)
    rows = []
    for i, s in enumerate(stats):
        cells = []
        for key, _ in SUMMARY_COLUMNS:
            v = s.get(key)
            if key == "status":
                color = STATUS_COLORS.get(str(v).split()[0], "#555")
                text = f'<b style="color:{color}">{html.escape(str(v))}</b>'
                if i < len(extra or []) and extra[i]:
                    text += f' <span style="color:#888">({html.escape(extra[i])})</span>'
                cells.append(f"<td>{text}</td>")
            elif key == "step":
                total = s.get("steps")
                txt = fmt_value(key, v) + (f" / {total:,}" if total else "")
                cells.append(f"<td>{txt}</td>")
            else:
                cells.append(f"<td>{html.escape(fmt_value(key, v))}</td>")
        rows.append(f"<tr><td><b>{html.escape(str(s.get('name')))}</b>"
                    f"<br><span style='color:#888'>{html.escape(str(s.get('algorithm') or ''))}"
                    f"</span></td>{''.join(cells)}</tr>")
    style = ("border-collapse:collapse;font-size:13px;font-family:sans-serif;"
             "font-variant-numeric:tabular-nums")
    return (f'<table class="lowband-summary" style="{style}"><thead><tr><th>run</th>{head}'
            f"</tr></thead><tbody>{''.join(rows)}</tbody></table>"
            "<style>.lowband-summary td,.lowband-summary th{padding:3px 10px;"
            "border-bottom:1px solid #ddd;text-align:right}"
            ".lowband-summary td:first-child,.lowband-summary th:first-child"
            "{text-align:left}</style>")
