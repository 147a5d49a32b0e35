"""Plotly figures of runs, shared by the live dashboard and the static report: one import for
all of them (`from lowband.dashboard import figures as F`).

Each builder returns a spec, (traces, layout): plain dicts that make a go.Figure for the report
(make_figure) or update a go.FigureWidget in place for the dashboard (update_figure). They live
beside this module, one concern each:

  style.py             palettes, the base layout, number formatting (fmt_*)
  specs.py             make_figure, update_figure: specs to plotly objects
  loss_figure.py       loss_spec, loss_figure_static (the report's, with x-axis buttons)
  bandwidth_figure.py  bandwidth_spec
  timeline_figure.py   timeline_spec
  tables.py            summary_html (the dashboard's summary panel), the report's tables

The dashboard's and the report's own modules import from those directly.
"""

from __future__ import annotations

from .bandwidth_figure import bandwidth_spec
from .loss_figure import downsample, loss_figure_static, loss_spec
from .specs import NUMERIC, make_figure, trace_signature, update_figure
from .style import (ANOMALY_COLOR, BASE_LAYOUT, COMPUTE_COLOR, DASHES, FAILED_COMMIT_COLOR,
                    FRAGMENT_PALETTE, INNER_COLOR, MAX_TAGS, MEMBERSHIP_COLOR, PALETTE,
                    RESTART_COLOR, XAXES, Spec, fmt_bits, fmt_bytes, fmt_rate, fmt_value,
                    fragment_colors)
from .tables import STATUS_COLORS, SUMMARY_COLUMNS, summary_html
from .timeline_figure import timeline_spec

__all__ = ["ANOMALY_COLOR", "BASE_LAYOUT", "COMPUTE_COLOR", "DASHES", "FAILED_COMMIT_COLOR",
           "FRAGMENT_PALETTE", "INNER_COLOR", "MAX_TAGS", "MEMBERSHIP_COLOR", "NUMERIC", "PALETTE",
           "RESTART_COLOR", "STATUS_COLORS", "SUMMARY_COLUMNS", "Spec", "XAXES", "bandwidth_spec",
           "downsample", "fmt_bits", "fmt_bytes", "fmt_rate", "fmt_value", "fragment_colors",
           "loss_figure_static", "loss_spec", "make_figure", "summary_html", "timeline_spec",
           "trace_signature", "update_figure"]
