"""The look every figure and table shares: palettes, the base layout, number formatting.

Used by the figure builders (loss_figure, bandwidth_figure, timeline_figure), the tables and
the report, so a colour or a unit is written once.
"""

from __future__ import annotations

import math

from lowband.units import fmt_si

from .records import _natural

PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf"]
FRAGMENT_PALETTE = ["#4e79a7", "#e15759", "#59a14f", "#b07aa1", "#edc948", "#76b7b2",
                    "#ff9da7", "#9c755f", "#f28e2b", "#bab0ac"]
DASHES = ["solid", "dot", "dash", "dashdot", "longdash", "longdashdot"]
COMPUTE_COLOR = "rgba(110,140,190,0.35)"
INNER_COLOR = "#f0a04b"
ANOMALY_COLOR = "#d62728"
MEMBERSHIP_COLOR = "#7b3294"      # replica groups joining or leaving an --elastic run's quorum
FAILED_COMMIT_COLOR = "#e6550d"   # an --elastic outer sync whose commit vote failed (not applied)
RESTART_COLOR = "#00897b"         # an attempt that continued the run after a crash or a requeue
# the loss figure's x axes: their titles, and the labels of the buttons that pick them
XAXES = {"step": "step", "tokens": "tokens (whole run)", "time": "wall-clock time (s of training)",
         "bytes": "outer-link bytes (whole run)"}
XAXIS_BUTTONS = {"step": "step", "tokens": "tokens", "time": "wall time", "bytes": "outer bytes"}
MAX_TAGS = 10

BASE_LAYOUT = dict(template="plotly_white", margin=dict(l=60, r=20, t=40, b=45),
                   legend=dict(font=dict(size=11)), uirevision="lowband")

# A figure as plain data: (traces, layout), both dicts (specs.py turns it into plotly objects)
Spec = tuple[list[dict], dict]


def figure_title(text: str) -> dict:
    """A figure title, as every figure places it."""
    return dict(text=text, x=0.01, font=dict(size=15))


def empty_note(text: str) -> dict:
    """An annotation in the middle of an empty figure."""
    return dict(text=text, xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False,
                font=dict(color="#888", size=14))


def fragment_colors(tags) -> dict[str, str]:
    """A colour per fragment or block tag, in natural order ("frag2" before "frag10")."""
    ordered = sorted(set(tags), key=_natural)
    return {tag: FRAGMENT_PALETTE[i % len(FRAGMENT_PALETTE)] for i, tag in enumerate(ordered)}


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
    if isinstance(v, (list, tuple)):  # steps_run_per_replica: one value per replica
        return ", ".join(fmt_value(key, x) for x in v) or "–"
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if isinstance(v, float) and not math.isfinite(v):
            return "–"
        if key.endswith("bytes_per_s") or key.endswith("_per_s") and "bytes" in key:
            return fmt_rate(v)
        if key.endswith("bytes") or key == "bytes_per_token":
            return fmt_bytes(v)
        if key == "compute_utilization":
            return f"{100 * v:.1f} %"
        if key.endswith("_error"):  # a relative miss, e.g. planned / measured - 1
            return f"{v:+.0%}"
        if key.endswith("loss"):
            return f"{v:.4f}"
        if key.endswith("_s") and not key.endswith("_per_s"):
            return f"{v:.3g} s" if v < 10 else f"{v:,.1f} s"
        if isinstance(v, int) or float(v).is_integer():
            return f"{int(v):,}"
        return fmt_si(v)
    return str(v)
