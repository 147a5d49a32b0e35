"""The sync timeline: one lane per rank on a seconds axis, with its step windows (compute),
inner and outer transfers (outer ones coloured by fragment or block), outer steps, the restarts
of a continued run and, in --elastic runs, the membership changes each replica group saw and
the outer steps whose commit vote failed."""

from __future__ import annotations

import math

from .commits import commit_text
from .model import RunModel
from .records import _natural
from .restarts import restart_text
from .membership import heal_text
from .style import (ANOMALY_COLOR, BASE_LAYOUT, COMPUTE_COLOR, FAILED_COMMIT_COLOR, INNER_COLOR,
                    MAX_TAGS, MEMBERSHIP_COLOR, RESTART_COLOR, Spec, empty_note, figure_title,
                    fmt_bytes, fragment_colors)


def timeline_spec(model: RunModel, window_s: float | None = 30.0, keep_s: float | None = None,
                  max_spans: int = 3000, follow: bool = True) -> Spec:
    """One lane per rank: step windows (compute), inner and outer transfers, outer steps,
    restarts (on each lane, when its rank resumed), membership changes (on the lanes of the
    group that saw them) and outer steps whose commit vote failed (none of those two without
    --elastic).

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
    traces += _membership_traces(model, lane, replica_of, t0, cut, max_spans)
    traces += _commit_traces(model, lane, t0, cut, max_spans)
    traces += _restart_traces(model, lane, t0, cut, max_spans)
    xaxis = dict(title=dict(text="seconds since start"))
    if follow and window_s:
        lo = max(t_hi - window_s, 0.0)
        xaxis.update(range=[lo, t_hi + 0.02 * max(t_hi - lo, 1e-3)], autorange=False)
    n = max(len(ranks), 1)
    layout = dict(BASE_LAYOUT, barmode="overlay", height=min(120 + 46 * n, 760),
                  title=figure_title(f"sync timeline · {model.name}"),
                  xaxis=xaxis,
                  yaxis=dict(tickvals=list(range(len(ranks))),
                             ticktext=[f"rank {r} (rep {replica_of.get(r, '?')})" for r in ranks],
                             autorange="reversed", showgrid=False, zeroline=False),
                  annotations=[] if ranks else [empty_note("no events yet")])
    return traces, layout


def _membership_traces(model: RunModel, lane: dict, replica_of: dict, t0: float, cut: float,
                       max_spans: int) -> list:
    """A tick across each lane of a replica group at the time it saw a new quorum (a star where
    it was healed); nothing for a run without membership events."""
    records = [r for r in model.membership() if r.t - t0 >= cut][-max_spans:]
    if not records:
        return []
    xs, ys, texts, symbols = [], [], [], []
    for rec in records:
        ranks = [r for r in lane if replica_of.get(r) == rec.replica] or \
            [r for r in rec.ranks if r in lane]
        for r in ranks:
            xs.append(rec.t - t0)
            ys.append(lane[r])
            texts.append(_membership_text(rec, r))
            symbols.append("star" if rec.healed else "line-ns-open")
    return [dict(type="scatter", mode="markers", name="membership change", x=xs, y=ys,
                 text=texts, hoverinfo="text",
                 marker=dict(symbol=symbols, size=[13 if s == "star" else 22 for s in symbols],
                             color=MEMBERSHIP_COLOR,
                             line=dict(width=2, color=MEMBERSHIP_COLOR)))]


def _commit_traces(model: RunModel, lane: dict, t0: float, cut: float, max_spans: int) -> list:
    """A crossed-out diamond where an outer step's diamond would be, on the lane of each rank
    that reported its commit vote failed (its outer update not applied); nothing without."""
    points = [(t - t0, lane[r], f"{commit_text(c)}<br>rank {r}, group {q}")
              for c in model.failed_commits() for r, q, t in c.reports
              if r in lane and t - t0 >= cut][-max_spans:]
    if not points:
        return []
    xs, ys, texts = zip(*points)
    return [dict(type="scatter", mode="markers", name="failed commit (not applied)", x=list(xs),
                 y=[y - 0.22 for y in ys], text=list(texts), hoverinfo="text",
                 marker=dict(symbol="diamond-x-open", size=11, color=FAILED_COMMIT_COLOR,
                             line=dict(width=2, color=FAILED_COMMIT_COLOR)))]


def _restart_traces(model: RunModel, lane: dict, t0: float, cut: float, max_spans: int) -> list:
    """A teal triangle on the lane of each rank at the time it resumed (or started over) in an
    attempt that continued the run; nothing for a run that never restarted."""
    points = [(t - t0, lane[r], f"{restart_text(rec)}<br>rank {r}")
              for rec in model.restarts() for r, t in rec.reports
              if r in lane and t - t0 >= cut][-max_spans:]
    if not points:
        return []
    xs, ys, texts = zip(*points)
    return [dict(type="scatter", mode="markers", name="restart", x=list(xs), y=list(ys),
                 text=list(texts), hoverinfo="text",
                 marker=dict(symbol="triangle-right", size=13, color=RESTART_COLOR,
                             line=dict(width=1, color="#222")))]


def _membership_text(rec, rank: int) -> str:
    parts = [f"rank {rank}, group {rec.replica}: {rec.change}"]
    if rec.step is not None:
        parts.append(f"step {rec.step}")
    if rec.quorum_id is not None:
        parts.append(f"quorum {rec.quorum_id}")
    if rec.members:
        parts.append(f"groups {', '.join(map(str, rec.members))}")
    if rec.healed:
        parts.append(f"healed {heal_text(rec.heal_bytes, rec.heal_s)}".rstrip())
    if rec.wait_s is not None:
        parts.append(f"quorum wait {rec.wait_s:.3g} s")
    return ", ".join(parts)


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
