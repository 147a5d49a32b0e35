"""The outer-link bandwidth figure: bytes per second over time (RunModel.bandwidth binned),
its peak and mean, and the emulated link's capacity. A run's peak is the highest bin of one of
its links, as the summary table's "outer peak bandwidth" gives it (the same bins), with one
run or several."""

from __future__ import annotations

import numpy as np

from .bandwidth import BINS
from .model import RunModel
from .style import (ANOMALY_COLOR, BASE_LAYOUT, PALETTE, Spec, empty_note, figure_title,
                    fmt_bits, fmt_rate)


def bandwidth_spec(models: list[RunModel], max_bins: int = BINS) -> Spec:
    """Bytes per second on the outer link over time, its mean and peak and the capacity: a
    line per link for one run, a line per run (its mean per link) for several."""
    multi = len(models) > 1
    traces: list[dict] = []
    capacities = {}
    any_data = False
    for ri, m in enumerate(models):
        if m.capacity():  # (a measured link's, --link FILE, says so: the report's #summary)
            measured = bool((m.config.get("meta") or {}).get("link"))
            capacities.setdefault(m.capacity(), (m.name, measured))
        bw = m.bandwidth(max_bins=max_bins, by="total" if multi else "link")
        if not bw["series"]:
            continue
        any_data = True
        if multi:
            traces += _run_traces(m.name, bw, m.bandwidth(max_bins=max_bins),
                                  PALETTE[ri % len(PALETTE)])
        else:
            traces += _link_traces(bw)
    if any_data:
        x_end = max((float(t["x"][-1]) for t in traces if len(t["x"])), default=1.0)
        for cap, (name, measured) in capacities.items():
            label = (f"capacity {fmt_bits(cap)}" + (" measured" if measured else "")
                     + (f" ({name})" if multi else ""))
            traces.append(dict(type="scatter", mode="lines", x=[0, x_end], y=[cap, cap],
                               name=label, line=dict(color=ANOMALY_COLOR, dash="dot", width=1.5)))
    layout = dict(BASE_LAYOUT, title=figure_title("outer-link bandwidth"),
                  xaxis=dict(title=dict(text="seconds since start")),
                  yaxis=dict(title=dict(text="bytes/s"), tickformat="~s", rangemode="tozero"),
                  annotations=[] if any_data else [empty_note("no outer-link traffic yet")])
    return traces, layout


def peak(by_link: dict) -> tuple[float, float, str]:
    """(the middle of its bin, the rate, the link) of the highest bin of one link: a run's peak
    (by_link: RunModel.bandwidth by link, whose "peak" it is)."""
    key = max(by_link["series"], key=lambda k: by_link["series"][k].max())
    i = int(np.argmax(by_link["series"][key]))
    return by_link["edges"][i] + by_link["width"] / 2, by_link["series"][key][i], key


def _run_traces(name: str, bw: dict, by_link: dict, color: str) -> list[dict]:
    """One run among several: its mean rate per link, and its peak (its busiest link's highest
    bin, which can lie above the mean over its links)."""
    edges = bw["edges"]
    rate = bw["series"]["all links"] / max(bw["links"], 1)
    x, top, key = peak(by_link)
    return [
        dict(type="scatter", mode="lines", line_shape="hv", name=f"{name} (mean per link)",
             legendgroup=name, x=edges, y=np.append(rate, rate[-1]),
             line=dict(color=color, width=1.5)),
        dict(type="scatter", mode="markers", legendgroup=name, name=f"{name} peak {fmt_rate(top)}",
             x=[x], y=[top], text=[f"{name} peak {fmt_rate(top)} ({key}, {bw['width']:g} s bins)"],
             hoverinfo="text", marker=dict(color=color, size=9, symbol="triangle-up")),
    ]


def _link_traces(bw: dict) -> list[dict]:
    """One run alone: a line per link (or direction), the peak, the busiest link's mean."""
    edges = bw["edges"]
    traces = []
    for k, (key, rate) in enumerate(bw["series"].items()):
        traces.append(dict(type="scatter", mode="lines", line_shape="hv", name=key,
                           x=edges, y=np.append(rate, rate[-1]),
                           fill="tozeroy" if len(bw["series"]) == 1 else None,
                           line=dict(color=PALETTE[k % len(PALETTE)], width=1.5)))
    x, top, key = peak(bw)
    traces.append(dict(type="scatter", mode="markers", name=f"peak {fmt_rate(top)}",
                       x=[x], y=[top],
                       text=[f"peak {fmt_rate(top)} ({key}, {bw['width']:g} s bins)"],
                       hoverinfo="text", marker=dict(color="#333", size=9, symbol="triangle-up")))
    traces.append(dict(type="scatter", mode="lines", x=[edges[0], edges[-1]],
                       y=[bw["mean"], bw["mean"]],
                       name=f"mean {fmt_rate(bw['mean'])} (busiest link)",
                       line=dict(color="#333", dash="dash", width=1)))
    return traces
