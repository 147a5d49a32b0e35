"""The offline HTML report of one or more runs: write_report (Dashboard.export_html and the
`lowband report` command, lowband/report.py, both call it).

One self-contained file: plotly.js is embedded inline (no CDN, nothing fetched when opened),
with the dashboard's figures (built by the same code), the summary and config of every run side
by side, the restarts of runs continued after a crash or a requeue, and the membership changes
and failed commit votes of --elastic runs. Runs that have not finished are reported as they
stand.

A `lowband compare` adds its table first (#compare: comparison.py) and opens the loss figure on
wall-clock time.

For tests in a browser, the page has stable hooks: figure divs #lowband-loss,
#lowband-bandwidth and #lowband-timeline-<i>, sections #headline (what ddp would have sent, as
`lowband train` prints it: runs that are not ddp), #summary (with a run's measured link, --link
FILE, above its table), #replicas (runs of two replicas or
more: each replica's work), #config (#restarts for runs
that restarted, #membership for --elastic runs, with #failed-commits where a commit vote
failed), and the report's numbers as JSON in <script type="application/json"
id="lowband-report-data">.
"""

from __future__ import annotations

import datetime as _dt
import html
import json
import math
import os
from pathlib import Path

from lowband.options import UserError, filesystem_error, needs_extra
from lowband.summary import comparison, fault_text, guard_text
from lowband.telemetry import atomic_path

from .bandwidth_figure import bandwidth_spec
from .comparison import compare_section
from .loss_figure import loss_figure_static
from .losses import warmup_text
from .model import RunModel, is_run_dir
from .replicas import COLUMNS as REPLICA_COLUMNS
from .replicas import replicas_table
from .specs import make_figure
from .tables import (commits_table, config_table, elastic_text, link_text, membership_table,
                     participation_table, restarts_table, run_record, summary_table)
from .timeline_figure import timeline_spec


class ReportError(UserError, ValueError):
    """Bad input a user can fix (a missing or wrong directory, an unwritable output)."""


def _source_dir(source) -> Path:
    path = getattr(source, "run_dir", source)
    if path is None:
        raise ReportError("a launch handle has no run directory yet; start it first.")
    return Path(path)


def load_runs(run_dirs) -> list[RunModel]:
    """A loaded RunModel per run directory (or launch handle), checking each is a run."""
    if isinstance(run_dirs, (str, os.PathLike)) or hasattr(run_dirs, "run_dir"):
        run_dirs = [run_dirs]
    run_dirs = list(run_dirs)
    if not run_dirs:
        raise ReportError("give at least one run directory.")
    models = []
    for src in run_dirs:
        p = _source_dir(src)
        if not p.exists():
            raise ReportError(f"{p} does not exist; give the directory of a run "
                              f"(the one holding config.json and events/).")
        if not is_run_dir(p):
            raise ReportError(f"{p} is not a lowband run directory: it has neither config.json "
                              f"nor events/ inside it.")
        models.append(RunModel(p).load())
    return models


def _figure_html(fig, div_id: str, height: int) -> str:
    fig.update_layout(height=height)
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id,
                       default_width="100%", default_height=f"{height}px",
                       config={"displaylogo": False, "responsive": True})


CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#222;
background:#fafafa}
header{padding:18px 28px 6px;background:#fff;border-bottom:1px solid #e5e5e5}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:24px 0 8px}h3{font-size:14px;
margin:16px 0 4px;color:#444}
main{padding:0 28px 40px;max-width:1500px}
.meta{color:#777;font-size:13px;margin:0 0 10px}
section{background:#fff;border:1px solid #e5e5e5;border-radius:6px;padding:6px 16px 12px;
margin-top:16px}
table.grid{border-collapse:collapse;font-size:13px;font-variant-numeric:tabular-nums}
table.grid th,table.grid td{padding:4px 12px;border-bottom:1px solid #eee;text-align:right;
vertical-align:top}
table.grid th:first-child{text-align:left;font-weight:600;color:#444}
table.grid thead th{border-bottom:2px solid #ccc;text-align:right}
table.grid tr.diff td{background:#fff4d6}
table.grid tr.group th{text-align:left;color:#777;font-weight:600;padding-top:12px;
border-bottom:1px solid #ccc}
details summary{cursor:pointer;color:#555;font-size:13px;margin:10px 0 4px}
#headline p{font-size:15px;margin:8px 0}
.ratio{color:#888;font-size:11px}
.scroll{overflow-x:auto}
"""


def render_report(run_dirs, *, title: str | None = None, window_s: float | None = None,
                  max_points: int = 2000, max_spans: int = 5000, compare: dict | None = None) -> str:
    """The report's HTML as a string (see write_report)."""
    needs_extra("ui", "the HTML report", "plotly")
    from plotly.offline import get_plotlyjs

    models = load_runs(run_dirs)
    names = [m.name for m in models]
    title = title or "lowband report · " + ", ".join(names)
    records = [run_record(m) for m in models]
    loss = loss_figure_static(models, max_points=max_points, xaxis="time" if compare else None)
    bandwidth = make_figure(bandwidth_spec(models))
    lines = ("one line per rank (each rank sends over its own link)" if len(models) == 1
             else "each run's mean per link")
    elastic = any(m.membership() or m.failed_commits() for m in models)
    failed = any(m.failed_commits() for m in models)
    restarts = restarts_table(models)
    parts = [compare_section(compare)] if compare else []
    parts += [_headline_section(models)] if any(_headline(m) for m in models) else []
    parts += [
        f'<section id="summary"><h2>Summary</h2>{_link_notes(models)}<div class="scroll">'
        f"{summary_table(records)}</div>{_guard_notes(models)}</section>",
        _replicas_section(models),
        f'<section id="loss-section"><h2>Loss</h2><p class="meta">Mean over each replica\'s '
        f"ranks; validation loss, loss spikes (EWMA z-score, z &gt; {models[0].spike_params[0]:g};"
        f" the grey band is {html.escape(warmup_text(models[0].spike_params[2]))})"
        f" and outer syncs (vertical lines)"
        + ("; replica groups joining and leaving the quorum (dashed purple lines)"
           if elastic else "")
        + ("; outer syncs whose commit vote failed, their update skipped (dotted orange lines)"
           if failed else "")
        + ("; restarts, at the step each attempt resumed from (dash-dot teal lines)"
           if restarts else "")
        + f". The buttons switch the x axis.</p>{_figure_html(loss, 'lowband-loss', 460)}"
        "</section>",
        f'<section id="bandwidth-section"><h2>Outer-link bandwidth</h2><p class="meta">Bytes on '
        f"the wire per second, each transfer spread evenly over its transmission window; {lines}"
        f"; the peak is the highest bin, so it depends on the bin width.</p>"
        f"{_figure_html(bandwidth, 'lowband-bandwidth', 340)}</section>",
    ]
    if restarts:
        parts.append('<section id="restarts"><h2>Restarts</h2><p class="meta">One row per '
                     "attempt that continued a run after a crash or a Slurm requeue: the step it "
                     "resumed from (0: it started over) and the steps of the lost attempt it "
                     "redid. The lost attempt's events are left out of every figure and number."
                     + (" An --elastic replica group restarts alone: its row names it, and the "
                        "step a live peer healed it to, after which it redid none."
                        if "<th>group</th>" in restarts else "")
                     + f'</p><div class="scroll">{restarts}</div></section>')
    if elastic:
        parts.append(_membership_section(models))
    plan = _plan_section([m.run_dir for m in models if m.finished])
    if plan:
        parts.append(plan)
    tl_parts = []
    for i, m in enumerate(models):
        spec = timeline_spec(m, window_s, max_spans=max_spans, follow=window_s is not None)
        fig = make_figure(spec)
        tl_parts.append(f"<h3>{html.escape(m.name)}</h3>"
                        + _figure_html(fig, f"lowband-timeline-{i}", spec[1]["height"]))
    parts.append('<section id="timeline-section"><h2>Sync timeline</h2><p class="meta">One lane '
                 "per rank: step windows (light), inner transfers (above the lane's middle), "
                 "outer transfers and outer steps (below; colour tells fragments apart)"
                 + ("; membership changes on the lanes of the group that saw them (a star where "
                    "it was healed)" if elastic else "")
                 + ("; a crossed-out orange diamond where a rank's commit vote failed (the outer "
                    "step not applied)" if failed else "")
                 + ("; a teal triangle where a rank resumed after a restart" if restarts else "")
                 + ". Drag to zoom, double-click to see everything.</p>" + "".join(tl_parts)
                 + "</section>")
    parts.append(f'<section id="config"><h2>Config</h2><div class="scroll">'
                 f"{config_table(models)}</div></section>")
    data = {"title": title, "runs": [
        {"name": m.name, "dir": str(m.run_dir), "finished": m.finished,
         "stats": rec, "config": m.config,
         "replicas": [dict(r._asdict(), utilization=r.utilization) for r in m.replica_work()],
         **({"membership": [r._asdict() for r in m.membership()]} if m.membership() else {}),
         **({"failed_commits": [c._asdict() for c in m.failed_commits()]}
            if m.failed_commits() else {}),
         **({"restarts": [r._asdict() for r in m.restarts()]} if m.restarts() else {})}
        for m, rec in zip(models, records)], **({"compare": compare} if compare else {})}
    data_json = json.dumps(_clean(data), allow_nan=False).replace("</", "<\\/")
    generated = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        f"<title>{html.escape(title)}</title><style>{CSS}</style>"
        f'<script type="text/javascript">{get_plotlyjs()}</script></head><body>'
        f"<header><h1>{html.escape(title)}</h1><p class=\"meta\">{len(models)} run"
        f"{'s' if len(models) > 1 else ''} · generated {html.escape(generated)} by lowband"
        "</p></header><main>" + "".join(parts) + "</main>"
        f'<script type="application/json" id="lowband-report-data">{data_json}</script>'
        "</body></html>\n")


def _headline(m: RunModel) -> str:
    """The sentence `lowband train` printed beside the run's one line (lowband.summary.comparison):
    how many times fewer bytes than ddp it sent, and on its link the link time ddp's would take a
    step against its compute a step; "" for ddp and for a run without a summary."""
    return comparison(m.summary or {}, m.config.get("link_bandwidth")) if m.summary else ""


def _headline_section(models: list[RunModel]) -> str:
    lines = [(f"<b>{html.escape(m.name)}</b>: " if len(models) > 1 else "")
             + html.escape(_headline(m)) + "." for m in models if _headline(m)]
    return '<section id="headline">' + "".join(f"<p>{line}</p>" for line in lines) + "</section>"


def _replicas_section(models: list[RunModel]) -> str:
    """Each replica's work, where some run has two replicas or more ("" otherwise)."""
    table = replicas_table(models)
    if not table:
        return ""
    words = "; ".join(f"{head}: {what}" for head, what in REPLICA_COLUMNS[1:])
    return ('<section id="replicas"><h2>Replicas</h2><p class="meta">One row per replica, from '
            f"its ranks' step and sync events: {html.escape(words)}. Under fixed local steps a "
            "replica faster than the others waits for them at each sync; with --local-steps "
            "adaptive it runs more steps instead.</p>"
            f'<div class="scroll">{table}</div></section>')


def _link_notes(models: list[RunModel]) -> str:
    """Each run's outer link where it emulated a measured one (--link FILE: what it emulated,
    and the record, as config.json's meta.link keeps it); "" where none did."""
    return "".join('<p class="meta" data-key="measured-link">'
                   + (f"{html.escape(m.name)}: " if len(models) > 1 else "")
                   + f"Outer link {html.escape(link_text(m.config))}.</p>"
                   for m in models if link_text(m.config))


def _guard_notes(models: list[RunModel]) -> str:
    """What the guard on the outer step left out (summary.json's `left_out`, the terminal's
    words first) and a diverged run's sentence, each run's; "" where there is nothing to say."""
    notes = []
    for m in models:
        s = m.summary or {}
        who = f"{html.escape(m.name)}: " if len(models) > 1 else ""
        if s.get("diverged"):
            notes.append(f'<p class="meta" data-key="diverged">{who}'
                         f"{html.escape(s['diverged'])}</p>")
        texts = [r["text"] for r in s.get("left_out") or []]
        if texts:
            items = "".join(f"<li>{html.escape(t)}</li>" for t in texts[:50])
            more = f"<li>and {len(texts) - 50} more</li>" if len(texts) > 50 else ""
            notes.append(f'<p class="meta" data-key="left_out">{who}{html.escape(guard_text(s))}'
                         f"</p><ul>{items}{more}</ul>")
    return "".join(notes)


def _membership_section(models: list[RunModel]) -> str:
    """The membership changes of the --elastic runs, their groups' restarts, their count of
    uncommitted syncs and the list of those (where a commit vote failed)."""
    notes = []
    for m in models:
        el = (m.summary or {}).get("elastic")
        parts = [f"replica group restarts: {html.escape(elastic_text('elastic.restarts', el))}",
                 "groups finished: "
                 f"{html.escape(elastic_text('elastic.groups_finished', el))}"] \
            if isinstance(el, dict) else []
        if fault_text(m.summary or {}):  # the terminal's words: deaths, restarts, heals, redone
            parts.append(html.escape(fault_text(m.summary)))
        if m.failed_commits():
            parts.append(f"uncommitted syncs: {len(m.failed_commits())} (commit vote failed, "
                         "outer update skipped)")
        if parts:
            who = f"{html.escape(m.name)}: " if len(models) > 1 else ""
            notes.append(who + "; ".join(parts))
    commits, taking_part = commits_table(models), participation_table(models)
    shares = [(f"{html.escape(m.name)}: " if len(models) > 1 else "") + m.participation_text()
              for m in models if m.participation_text()]
    return ('<section id="membership"><h2>Membership changes</h2><p class="meta">One row per '
            "replica group and quorum (--elastic): what that group saw change against its "
            "previous quorum; a healed group received a live peer's state (heal bytes summed "
            "over its ranks, heal time the slowest rank's)."
            + (" " + ". ".join(notes) + "." if notes else "")
            + f'</p><div class="scroll">{membership_table(models)}</div>'
            "<style>table.grid.membership td,table.grid.membership thead th{text-align:left}"
            "table.grid.membership tr.healed td{background:#f4ecf7}</style>"
            + ('<h3 id="participation">Participation</h3><p class="meta">Per sync (ddp: per '
               "step), the replica groups alive (heartbeating to the Lighthouse) and those that "
               "took part; a group healed in a sync takes part with weight 0. "
               + html.escape(". ".join(shares)) + ".</p>"
               f'<div class="scroll">{taking_part}</div><style>table.grid.participation td,'
               "table.grid.participation thead th{text-align:left}"
               "table.grid.participation tr.missing td{background:#fdebd0}</style>"
               if taking_part else "")
            + (f'<h3 id="failed-commits">Failed commit votes</h3><p class="meta">One row per '
               "outer sync whose commit vote failed in some replica group (a peer died "
               "mid-exchange, or the quorum was below --min-replicas). Each group votes for "
               "itself: the groups named skipped its outer update, the others applied it, and "
               "a group that skipped one takes a live peer's state at a later quorum. When "
               "every group skipped it, the "
               "fragment's next sync carried what this one would have.</p>"
               f'<div class="scroll">{commits}</div><style>table.grid.commits td,'
               "table.grid.commits thead th{text-align:left}</style>" if commits else "")
            + "</section>")


def _plan_section(run_dirs) -> str:
    """lowband plan's utilization-against-bandwidth curves with the runs on an emulated link as
    measured points; empty when no run had an emulated link or the plan cannot read a run."""
    from lowband.plan import PlanError, measured_figure

    try:
        fig = measured_figure(run_dirs)
    except (PlanError, KeyError, ValueError):
        return ""
    if fig is None:
        return ""
    return ('<section id="plan-section"><h2>Compute utilization against bandwidth</h2>'
            '<p class="meta">Curves: lowband plan for each run\'s config and its measured compute '
            "time per step (`lowband plan --config RUN`); circles: the planned utilization of "
            "each run on an emulated link, at its link; diamonds: the same runs as measured.</p>"
            f"{_figure_html(fig, 'lowband-plan', 420)}</section>")


def _clean(o):
    """JSON that a browser's JSON.parse reads: NaN and infinities become null."""
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, bool) or o is None or isinstance(o, (int, str)):
        return o
    try:
        f = float(o)
    except (TypeError, ValueError):
        return str(o)
    return f if math.isfinite(f) else None


def write_report(run_dirs, path, *, title: str | None = None, window_s: float | None = None,
                 max_points: int = 2000, max_spans: int = 5000, compare: dict | None = None) -> Path:
    """Write one self-contained offline HTML report of the runs in run_dirs (a run directory,
    a launch handle, or a list of them) to path. Several runs are overlaid and compared side by
    side. window_s: show the last window_s seconds of each timeline at first (default: all).
    compare: a `lowband compare` result, whose table opens the report. Raises ReportError for
    input a user can fix."""
    path = Path(path)
    if path.is_dir():
        raise ReportError(f"cannot write {path}: it is a directory; give a file name like "
                          f"{path / 'report.html'}.")
    if not path.parent.is_dir():
        raise ReportError(f"cannot write {path}: the directory {path.parent} does not exist.")
    text = render_report(run_dirs, title=title, window_s=window_s, max_points=max_points,
                         max_spans=max_spans, compare=compare)
    try:  # whole or not at all: a full disk leaves no half a page
        with atomic_path(path) as tmp:
            tmp.write_text(text, encoding="utf-8")
    except OSError as e:
        fault = filesystem_error(e)
        raise ReportError(str(fault) if fault else f"cannot write {path}: {e.strerror or e}."
                          ) from None
    return path
