"""Live JupyterLab dashboard of lowband runs: `Dashboard(run_dir)` (see docs/dashboard.md).

lowband.dashboard.model (event aggregation), .figures (plotly builders shared with the report)
and .export (the offline HTML report) import without ipywidgets; Dashboard itself needs the
`ui` extra. The modules of this package import each other, never this file.
"""

from __future__ import annotations

__all__ = ["Dashboard", "RunModel"]


def __getattr__(name):
    if name == "Dashboard":
        from lowband.options import needs_extra

        needs_extra("ui", "the Dashboard", "ipywidgets", "anywidget", "plotly")
        from .widget import Dashboard
        return Dashboard
    if name == "RunModel":
        from .model import RunModel
        return RunModel
    raise AttributeError(f"module 'lowband.dashboard' has no attribute {name!r}")
