"""The loss figure: loss per replica, validation loss, loss spikes, outer-sync marks, the
restarts of a continued run and the membership changes and failed commit votes of --elastic
runs, against steps, tokens, wall-clock time or outer-link bytes (loss_spec; where a point lies
on each: axes.py); and the report's version with x-axis buttons, opening on the axis that
compares its runs (opening_xaxis)."""

from __future__ import annotations

import numpy as np

from .commits import commit_text
from .losses import warmup_text
from .model import RunModel
from .restarts import restart_text
from .specs import make_figure
from .style import (ANOMALY_COLOR, BASE_LAYOUT, DASHES, FAILED_COMMIT_COLOR, MEMBERSHIP_COLOR,
                    PALETTE, RESTART_COLOR, XAXES, XAXIS_BUTTONS, Spec, empty_note, figure_title)


def downsample(n: int, max_points: int) -> np.ndarray:
    """Indices of at most max_points evenly strided points, always keeping the last one."""
    if n <= max_points:
        return np.arange(n)
    idx = np.linspace(0, n - 1, max_points).round().astype(int)
    return np.unique(idx)


def opening_xaxis(models: list[RunModel]) -> str:
    """The x axis a figure of these runs opens on: wall-clock time when they are of different
    algorithms (a step is not the same work across them: an adaptive acco step is several
    micro-batches, a ddp step one or two), else steps."""
    algos = {str(m.config.get("algo") or (m.summary or {}).get("algorithm")) for m in models}
    return "time" if len(algos) > 1 else "step"


def _at(m: RunModel, xaxis: str, step: int | None, t: float, replica: int):
    """(step, x) of a mark at time t: its step, else the step its replica was at then; x is None
    where unknown."""
    rs = m.replicas.get(replica)
    if step is None and rs is not None:
        step = rs.step_at(t)
    return step, m.x_of(xaxis, step, t, replica)


def _vlines(xs: list, texts: list) -> dict:
    """x, y and text of a vertical line across the y2 axis at each x (gaps between them)."""
    lines: dict = {"x": [], "y": [], "text": []}
    for x, text in zip(xs, texts):
        lines["x"] += [x, x, None]
        lines["y"] += [0, 1, None]
        lines["text"] += [text, text, None]
    return lines


def loss_spec(models: list[RunModel], xaxis: str = "step", max_points: int = 2000,
              max_marks: int = 500) -> Spec:
    """Loss per replica (mean over its ranks), validation loss, spikes, outer syncs and, for
    runs that have them, restarts, membership changes and failed commit votes."""
    multi = len(models) > 1
    traces: list[dict] = []
    for ri, m in enumerate(models):
        run_color = PALETTE[ri % len(PALETTE)]
        prefix = f"{m.name} · " if multi else ""
        group = m.name if multi else None
        for k, rep in enumerate(sorted(m.replicas)):
            rs = m.replicas[rep]
            idx = downsample(len(rs.steps), max_points)
            xs = [m.x_of(xaxis, rs.steps[i], rs.t[i], rep, rs.tokens[i], rs.clock[i]) for i in idx]
            traces.append(dict(
                type="scatter", mode="lines", name=f"{prefix}replica {rep}",
                x=xs, y=[rs.loss[i] for i in idx], legendgroup=group,
                line=dict(color=run_color if multi else PALETTE[k % len(PALETTE)],
                          dash=DASHES[k % len(DASHES)] if multi else "solid", width=1.5)))
        traces.append(dict(
            type="scatter", mode="lines+markers", name=f"{prefix}val loss",
            x=m.val_x(xaxis), y=m.val_series()[1], legendgroup=group,
            line=dict(color=run_color if multi else "#222", width=2),
            marker=dict(size=6, symbol="circle")))
        traces.append(_warmup_trace(m, xaxis, prefix, group))
        spikes = m.detected_spikes()[-max_marks:]
        z = m.spike_params[0]
        traces.append(dict(
            type="scatter", mode="markers", name=f"{prefix}loss spike (z>{z:g})",
            x=[m.x_of(xaxis, s.step, s.t, s.replica, s.tokens) for s in spikes],
            y=[s.loss for s in spikes],
            text=[f"replica {s.replica} step {s.step}: z={s.z:.1f}" for s in spikes],
            legendgroup=group,
            marker=dict(symbol="x", size=11, color=ANOMALY_COLOR, line=dict(width=1))))
        ev = m.spike_events[-max_marks:]
        traces.append(dict(
            type="scatter", mode="markers", name=f"{prefix}spike events",
            x=[m.x_of(xaxis, s.step, s.t, s.replica) for s in ev],
            y=[s.loss for s in ev], legendgroup=group,
            text=[f"trainer spike, replica {s.replica} step {s.step}: z={s.z:.1f}" for s in ev],
            marker=dict(symbol="star", size=11, color="#ff7f0e", line=dict(width=1)),
            visible=True if ev else "legendonly"))
        traces += _sync_traces(m, xaxis, max_marks, prefix, group,
                               run_color if multi else "#999")
        traces += _membership_traces(m, xaxis, max_marks, prefix, group)
        traces += _commit_traces(m, xaxis, max_marks, prefix, group)
        traces += _restart_traces(m, xaxis, max_marks, prefix, group)
    layout = dict(BASE_LAYOUT, title=figure_title("loss"),
                  xaxis=dict(title=dict(text=XAXES.get(xaxis, xaxis))),
                  yaxis=dict(title=dict(text="loss")),
                  yaxis2=dict(overlaying="y", range=[0, 1], visible=False, fixedrange=True),
                  annotations=[] if any(m.replicas for m in models)
                  else [empty_note("no step events yet")])
    return traces, layout


def _warmup_trace(m: RunModel, xaxis: str, prefix: str, group) -> dict:
    """A grey band over the first steps, which the spike detector does not judge (its warm-up:
    an early jump there is no spike), by the first replica's steps; a band of no points for a
    run without steps. Its five points stay where x is unknown, as the report's x-axis buttons
    need every axis's traces to have the same points."""
    warmup = m.spike_params[2]
    xs: list = []
    if m.replicas and warmup > 0:
        rep = min(m.replicas)
        rs = m.replicas[rep]
        first, last = 0, min(warmup, len(rs.steps)) - 1
        x0, x1 = (m.x_of(xaxis, rs.steps[i], rs.t[i], rep, rs.tokens[i], rs.clock[i])
                  for i in (first, last))
        xs = [x0, x1, x1, x0, x0]
    return dict(type="scatter", mode="lines", name=f"{prefix}spike detector warm-up", x=xs,
                y=[0, 0, 1, 1, 0] if xs else [], yaxis="y2", fill="toself",
                fillcolor="rgba(120,120,120,0.10)", line=dict(width=0), hoverinfo="text",
                text=[warmup_text(warmup)] * len(xs), legendgroup=group)


def _sync_traces(m: RunModel, xaxis: str, max_marks: int, prefix: str, group, color: str):
    """A faint vertical line per outer sync, and a red triangle on each anomalous one."""
    sx, stext = [], []
    ax, atext = [], []
    for mk in m.sync_marks()[-max_marks:]:
        step, x = _at(m, xaxis, mk.step, mk.t, mk.replica)
        if x is None:
            continue
        sx.append(x)
        stext.append(f"outer sync {mk.label}" + (f" step {step}" if step is not None else ""))
        if mk.anomaly:
            ax.append(x)
            atext.append(f"anomaly: {mk.label} step {step}")
    return [
        dict(type="scatter", mode="lines", name=f"{prefix}outer sync", yaxis="y2",
             hoverinfo="text", legendgroup=group, **_vlines(sx, stext),
             line=dict(color=color, width=1), opacity=0.35),
        dict(type="scatter", mode="markers", name=f"{prefix}anomalous sync", x=ax,
             y=[0.97] * len(ax), yaxis="y2", text=atext, hoverinfo="text", legendgroup=group,
             marker=dict(symbol="triangle-down", size=10, color=ANOMALY_COLOR),
             visible=True if ax else "legendonly"),
    ]


def _membership_traces(m: RunModel, xaxis: str, max_marks: int, prefix: str, group) -> list:
    """A dashed vertical line per quorum change of an --elastic run, labelled at its top ("group
    1 left"); nothing for a run without membership events."""
    marks = m.membership_marks()[-max_marks:]
    if not marks:
        return []
    px, ptext, label = [], [], []
    for mk in marks:
        # kept when x is unknown (a gap): every x axis's traces then have the same points,
        # which the report's x-axis buttons rely on
        step, x = _at(m, xaxis, mk.step, mk.t, mk.replica)
        px.append(x)
        ptext.append(f"{mk.text}<br>step {step if step is not None else '?'}, quorum "
                     f"{mk.quorum_id if mk.quorum_id is not None else '?'} of "
                     f"{mk.size if mk.size is not None else '?'} group"
                     f"{'' if mk.size == 1 else 's'}: {', '.join(map(str, mk.members)) or '?'}")
        label.append(mk.text)
    return _marked_lines(
        px, ptext, group if group is not None else "membership",
        dict(name=f"{prefix}membership change", opacity=0.7,
             line=dict(color=MEMBERSHIP_COLOR, width=1.5, dash="dash")),
        dict(name=f"{prefix}membership label", mode="markers+text", y=[0.9] * len(px),
             text=label, hovertext=ptext, textposition="middle right",
             textfont=dict(size=10, color=MEMBERSHIP_COLOR),
             marker=dict(symbol="diamond", size=8, color=MEMBERSHIP_COLOR)))


def _commit_traces(m: RunModel, xaxis: str, max_marks: int, prefix: str, group) -> list:
    """A dotted orange line per outer sync whose commit vote failed (--elastic: the groups whose
    vote failed skipped its outer update), a crossed-out diamond near its top; nothing for a run
    without."""
    xs, texts = [], []
    for c in m.failed_commits()[-max_marks:]:
        # x kept when unknown, as the membership marks' are
        xs.append(_at(m, xaxis, c.step, c.t, c.replicas[0] if c.replicas else 0)[1])
        texts.append(commit_text(c))
    if not xs:
        return []
    return _marked_lines(
        xs, texts, group if group is not None else "failed commit",
        dict(name=f"{prefix}failed commit", opacity=0.8,
             line=dict(color=FAILED_COMMIT_COLOR, width=1.5, dash="dot")),
        dict(name=f"{prefix}failed commit mark", y=[0.8] * len(xs),
             marker=dict(symbol="diamond-x-open", size=10, color=FAILED_COMMIT_COLOR,
                         line=dict(width=2, color=FAILED_COMMIT_COLOR))))


def _restart_traces(m: RunModel, xaxis: str, max_marks: int, prefix: str, group) -> list:
    """A dash-dot teal line at the step each restart resumed from (the steps after it, up to
    where the lost attempt got, were redone), a triangle near its top; nothing for a run that
    never restarted."""
    marks = m.restarts()[-max_marks:]
    if not marks:
        return []
    # x kept when unknown, as the membership marks' are
    xs = [_at(m, xaxis, r.step, r.t, r.replica)[1] for r in marks]
    return _marked_lines(
        xs, [restart_text(r) for r in marks], group if group is not None else "restart",
        dict(name=f"{prefix}restart", opacity=0.8,
             line=dict(color=RESTART_COLOR, width=1.5, dash="dashdot")),
        dict(name=f"{prefix}restart mark", y=[0.7] * len(xs),
             marker=dict(symbol="triangle-right", size=10, color=RESTART_COLOR)))


def _marked_lines(xs: list, hover: list, legend, line: dict, mark: dict) -> list:
    """A vertical line across the y2 axis at each x, in the legend, and a mark on each, not in
    it; both hover `hover` and toggle together. `line` and `mark` give each trace its name, look
    and anything else of its own (the mark's height on y2, y)."""
    return [
        {**dict(type="scatter", mode="lines", yaxis="y2", hoverinfo="text", legendgroup=legend,
                **_vlines(xs, hover)), **line},
        {**dict(type="scatter", mode="markers", x=xs, yaxis="y2", text=hover, hoverinfo="text",
                showlegend=False, legendgroup=legend, cliponaxis=False), **mark},
    ]


def loss_figure_static(models: list[RunModel], max_points: int = 2000, xaxis: str | None = None):
    """The loss figure with buttons that switch the x axis (step, tokens, wall time, outer
    bytes) in the browser: every axis's x data is embedded, nothing needs a kernel. It opens on
    `xaxis`, by default opening_xaxis(models)."""
    import plotly.graph_objects as go
    specs = {ax: loss_spec(models, ax, max_points) for ax in XAXES}
    first = xaxis or opening_xaxis(models)
    fig = make_figure(specs[first])
    buttons = [dict(label=XAXIS_BUTTONS[ax], method="update",
                    args=[{"x": [t["x"] for t in specs[ax][0]]},
                          {"xaxis.title.text": XAXES[ax], "xaxis.autorange": True}])
               for ax in XAXES]
    fig.update_layout(updatemenus=[go.layout.Updatemenu(
        type="buttons", direction="right", buttons=buttons, showactive=True,
        active=list(XAXES).index(first),
        x=1.0, xanchor="right", y=1.12, yanchor="bottom", pad=dict(r=0, t=0))],
        margin=dict(t=70))
    return fig
