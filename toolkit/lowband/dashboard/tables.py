"""Runs' numbers as HTML tables: the dashboard's summary panel (a row per run), the report's
summary and config tables (a column per run) and its lists of restarts, membership changes and
failed commit votes (--elastic)."""

from __future__ import annotations

import html
import json
import math

from lowband.comm.link import describe_measured, link_words

from .losses import warmup_text
from .membership import groups_text, participation_words
from .model import RunModel
from .restarts import lost_steps
from .style import fmt_bytes, fmt_value

# every number a run's summary or stats give, by its key: the label of its row in the report's
# summary table and of its column in the dashboard's summary panel (a key without one, a field
# of an algorithm from outside, reads with spaces for its underscores: label())
LABELS = {
    "status": "status", "algorithm": "algorithm", "replicas": "replicas",
    "shards": "shards per replica", "step": "step", "steps": "steps",
    "steps_run": "steps run (mean over replicas)",
    "steps_run_per_replica": "steps run by each replica",
    "micro_batches_per_step": "micro-batches per step and rank", "tokens": "tokens",
    "wall_s": "wall time", "tokens_per_s": "tokens/s", "compute_s": "compute time per rank",
    "compute_utilization": "compute utilization", "outer_wire_bytes": "outer bytes (wire)",
    "ddp_outer_wire_bytes": "outer bytes ddp would have sent",
    "ddp_steps": "ddp's steps for the same tokens",
    "inner_wire_bytes": "inner bytes (wire)", "setup_wire_bytes": "setup bytes (wire, once)",
    "peak_outer_payload_bytes": "peak outer payload", "bytes_per_token": "outer bytes/token",
    "peak_outer_bytes_per_s": "outer peak bandwidth",
    "mean_outer_bytes_per_s": "outer mean bandwidth (busiest link)",
    "link_capacity_bytes_per_s": "outer link capacity", "anomalies": "anomalous syncs",
    "spikes": "loss spikes", "left_out_updates": "updates left out (guard)",
    "diverged": "diverged", "loss": "loss", "val_loss": "val loss", "final_loss": "final loss",
    "final_val_loss": "final validation loss", "run_dir": "run directory",
    # summary.json's `elastic` (--elastic runs)
    "elastic.groups_finished": "replica groups finished",
    "elastic.restarts": "replica group restarts",
    "elastic.participation": "groups taking part a sync",
    # summary.json's `target` (--target-loss)
    "target.loss": "target val loss", "target.elapsed_s": "time to target",
    "target.tokens": "tokens to target", "target.outer_bytes": "outer bytes to target",
    "target.step": "step at target",
}


def label(key: str) -> str:
    """The human label of a summary or stats key."""
    return LABELS.get(key) or key.replace("_", " ").replace(".", ": ")


def _labelled(*keys: str) -> list[tuple[str, str]]:
    return [(key, LABELS[key]) for key in keys]


# the dashboard's summary panel
SUMMARY_COLUMNS = _labelled("status", "step", "tokens_per_s", "compute_utilization",
                            "bytes_per_token", "peak_outer_bytes_per_s", "anomalies", "spikes",
                            "loss", "val_loss")
STATUS_COLORS = {"running": "#2ca02c", "finished": "#1f77b4", "stalled": "#d62728",
                 "waiting": "#888", "ended": "#1f77b4", "failed": "#d62728",
                 "cancelled": "#ff7f0e"}

# the report's summary table
SUMMARY_ROWS = _labelled(
    "status", "algorithm", "replicas", "shards", "steps", "tokens", "wall_s", "tokens_per_s",
    "compute_utilization", "outer_wire_bytes", "ddp_outer_wire_bytes", "inner_wire_bytes",
    "peak_outer_payload_bytes", "bytes_per_token", "peak_outer_bytes_per_s",
    "mean_outer_bytes_per_s", "link_capacity_bytes_per_s", "anomalies", "left_out_updates",
    "spikes", "final_loss", "final_val_loss")
# summary.json's `elastic` (--elastic runs), shown as rows of their own when a run has it
ELASTIC_ROWS = _labelled("elastic.groups_finished", "elastic.restarts", "elastic.participation")
# summary.json's `target` (--target-loss), rows of their own when a run has it; older runs
# and runs without a target show "–"
TARGET_ROWS = _labelled("target.loss", "target.elapsed_s", "target.tokens",
                        "target.outer_bytes", "target.step")
# rows where a comparison with the first run is worth a ratio
RATIO_ROWS = {"wall_s", "tokens_per_s", "outer_wire_bytes", "ddp_outer_wire_bytes",
              "inner_wire_bytes", "peak_outer_payload_bytes", "bytes_per_token",
              "peak_outer_bytes_per_s", "mean_outer_bytes_per_s", "target.elapsed_s",
              "target.tokens", "target.outer_bytes"}


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


def run_record(m: RunModel) -> dict:
    """What the report shows about a run: summary.json values where they exist, the live
    estimates of RunModel.stats otherwise, and any other summary fields after those."""
    stats = m.stats()
    summary = m.summary or {}
    rec = dict(stats)
    rec["final_loss"] = stats["loss"]
    rec["final_val_loss"] = stats["val_loss"]
    rec["spike_warmup"] = m.spike_params[2]
    for key in ("replicas", "shards", "steps"):
        v = summary.get(key, m.config.get(key))
        if v is not None:
            rec[key] = v
    for key, v in summary.items():
        if key not in rec and key != "algorithm":
            rec[key] = v
    if not m.finished:
        rec["status"] = f"{stats['status']} (no summary.json yet: live estimates)"
    elif summary.get("diverged"):
        rec["status"] = "diverged"
    return rec


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _cell(v) -> str:
    if isinstance(v, (dict, list)):
        return html.escape(json.dumps(v))
    if v is None:
        return "–"
    return html.escape(str(v))


def summary_table(records: list[dict]) -> str:
    """The report's summary: a row per number, a column per run (records from run_record),
    sizes and rates also as a ratio to the first run."""
    names = [r["name"] for r in records]
    head = "".join(f"<th>{html.escape(n)}</th>" for n in names)
    keys = [k for k, _ in SUMMARY_ROWS]
    extra = sorted({k for r in records for k in r} - set(keys)
                   - {"name", "loss", "val_loss", "step", "spike_warmup", "left_out", *NESTED})
    nested = [row for name, (rows, _) in NESTED.items()
              if any(isinstance(r.get(name), dict) for r in records) for row in rows]
    rows = []
    for key, text in SUMMARY_ROWS + nested + [(k, label(k)) for k in extra]:
        cells = []
        base = _value(records[0], key)
        for i, r in enumerate(records):
            v = _value(r, key)
            name = key.split(".", 1)[0] if "." in key else None
            cell = html.escape(NESTED[name][1](key, r.get(name)) if name in NESTED
                               else fmt_value(key, v))
            if (i and key in RATIO_ROWS and isinstance(v, (int, float))
                    and isinstance(base, (int, float)) and base and math.isfinite(v)):
                cell += f' <span class="ratio">×{v / base:.3g}</span>'
            if key == "spikes" and r.get("spike_warmup"):
                note = html.escape(warmup_text(r["spike_warmup"]))
                cell += f' <span class="ratio">({note})</span>'
            cells.append(f'<td data-key="{html.escape(key)}">{cell}</td>')
        rows.append(f"<tr><th>{html.escape(text)}</th>{''.join(cells)}</tr>")
    return (f'<table class="grid"><thead><tr><th></th>{head}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table>")


def _value(record: dict, key: str):
    """A record's value of a summary row: `target.tokens` is its target's tokens."""
    if "." not in key:
        return record.get(key)
    inner = record.get(key.split(".", 1)[0])
    return inner.get(key.split(".", 1)[1]) if isinstance(inner, dict) else None


def target_text(key: str, target) -> str:
    """A cell of summary.json's `target`: the loss, and where it was reached what reaching it
    took; where not, "not reached (best 3.4100)" in the time row."""
    if not isinstance(target, dict):
        return "–"
    field = key.split(".", 1)[1]
    if field == "loss" or target.get("reached"):
        return fmt_value(field, target.get(field))
    best = target.get("best_val_loss")
    return ("not reached" + (f" (best {best:.4f})" if isinstance(best, (int, float)) else "")
            if field == "elapsed_s" else "–")


def measured_text(record: dict) -> str:
    """"the link in FILE, measured by lowband doctor ...": a measured link's record (--link
    FILE: config.json's meta.link, compare.json's link.measured) in one line."""
    return f"the link in {record.get('file') or 'a measured link file'}, " + \
        describe_measured(record)


def link_text(config: dict) -> str:
    """A run's outer link where it emulated a measured one (--link FILE, its config.json's
    meta.link): what it emulated, then measured_text; "" for any other run."""
    record = (config.get("meta") or {}).get("link")
    if not isinstance(record, dict):
        return ""
    return (f"emulated {link_words(config.get('link_bandwidth'), config.get('link_latency'))}"
            f" (its slowest direction and its latency): {measured_text(record)}")


def elastic_text(key: str, elastic) -> str:
    """A cell of summary.json's `elastic`: the groups that finished ("0, 1, 2"), the restarts
    of each group ("group 1: 1", "none"), the participation ("3.8 of 4.0 alive ...")."""
    if not isinstance(elastic, dict):
        return "–"
    v = elastic.get(key.split(".", 1)[1])
    if key == "elastic.participation":
        return participation_words(v) or "–"
    if isinstance(v, dict):
        return ", ".join(f"group {g}: {n}" for g, n in sorted(v.items(), key=lambda x: str(x[0])))\
            or "none"
    if isinstance(v, (list, tuple)):
        return ", ".join(str(g) for g in v) or "none"
    return "–" if v is None else str(v)


def membership_table(models: list[RunModel]) -> str:
    """The membership changes of --elastic runs, one row per replica group and quorum (its ranks'
    events merged): "" when no run has any."""
    runs = [(m, m.membership()) for m in models]
    if not any(records for _, records in runs):
        return ""
    multi = len(models) > 1
    head = (["run"] if multi else []) + ["step", "time", "group", "change", "quorum", "groups",
                                         "heal bytes", "heal time", "quorum wait"]
    rows = []
    for m, records in runs:
        for r in records:
            cells = _when(m, r, multi) + [
                str(r.replica),
                html.escape(r.change),
                ("–" if r.quorum_id is None else f"{r.quorum_id}")
                + ("" if r.size is None else f" ({r.size} group{'' if r.size == 1 else 's'})"),
                ", ".join(str(g) for g in r.members) or "–",
                html.escape(fmt_bytes(r.heal_bytes)) if r.healed else "–",
                fmt_value("heal_s", r.heal_s) if r.healed else "–",
                fmt_value("wait_s", r.wait_s)]
            cls = ' class="healed"' if r.healed else ""
            rows.append(f"<tr{cls}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return _grid("membership", head, rows)


def participation_table(models: list[RunModel]) -> str:
    """Per sync of --elastic runs, the groups alive (the Lighthouse's heartbeats) and the groups
    that took part, a row where some alive group did not: "" when no run recorded any."""
    runs = [(m, m.participation()) for m in models]
    if not any(rows for _, rows in runs):
        return ""
    multi = len(models) > 1
    head = (["run"] if multi else []) + ["step", "alive", "took part", "of them healed",
                                         "alive, not taking part"]
    out = []
    for m, rows in runs:
        for step, alive, took, healed in rows:
            missing = sorted(set(alive) - set(took))
            cells = ([html.escape(m.name)] if multi else []) + [
                f"{step:,}", f"{len(alive)}: " + (", ".join(map(str, alive)) or "–"),
                f"{len(took)}: " + (", ".join(map(str, took)) or "–"),
                ", ".join(map(str, healed)) or "–", ", ".join(map(str, missing)) or "–"]
            cls = ' class="missing"' if missing else ""
            out.append(f"<tr{cls}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return _grid("participation", head, out)


def commits_table(models: list[RunModel]) -> str:
    """The outer syncs of --elastic runs whose commit vote failed in some group (those groups
    skipped their outer update), one row per step and fragment: "" when no run has any."""
    runs = [(m, m.failed_commits()) for m in models]
    if not any(records for _, records in runs):
        return ""
    multi = len(models) > 1
    head = (["run"] if multi else []) + ["step", "time", "fragment", "reported by", "ranks"]
    rows = []
    for m, records in runs:
        for c in records:
            cells = _when(m, c, multi) + [
                html.escape(c.label if c.fragment is None else str(c.fragment)),
                groups_text(c.replicas) if c.replicas else "–",
                ", ".join(str(r) for r, _, _ in c.reports)]
            rows.append("<tr>" + "".join(f"<td>{x}</td>" for x in cells) + "</tr>")
    return _grid("commits", head, rows)


def restarts_table(models: list[RunModel]) -> str:
    """The attempts that continued a run after a crash or a Slurm requeue, one row each (with
    --elastic a replica group's restart from its checkpoint: its group, and the step a live
    peer healed it to, which leaves it no lost steps to redo): "" when no run has any."""
    runs = [(m, m.restarts()) for m in models]
    if not any(records for _, records in runs):
        return ""
    multi = len(models) > 1
    groups = any(r.group is not None for _, records in runs for r in records)  # --elastic
    head = (["run"] if multi else []) + ["resumed from step", "time"] + (
        ["group", "healed to step"] if groups else []) + ["attempt", "lost steps redone",
                                                          "Slurm requeue"]
    rows = []
    for m, records in runs:
        for r in records:
            cells = _when(m, r, multi) + ([
                "all" if r.group is None else str(r.group),
                "–" if r.healed_to is None else f"{r.healed_to:,}"] if groups else []) + [
                "–" if r.attempt is None else str(r.attempt), lost_steps(r) or "–",
                "–" if r.slurm_restart is None else str(r.slurm_restart)]
            rows.append("<tr>" + "".join(f"<td>{x}</td>" for x in cells) + "</tr>")
    return _grid("restarts", head, rows)


def _when(m: RunModel, r, multi: bool) -> list[str]:
    """The first cells of a row of a table of events: the run (several runs), step, time."""
    return ([html.escape(m.name)] if multi else []) + [
        "–" if r.step is None else f"{r.step:,}", f"{r.t - (m.t0 or 0.0):,.2f} s"]


def _grid(cls: str, head: list[str], rows: list[str]) -> str:
    return (f'<table class="grid {cls}"><thead><tr>' + "".join(f"<th>{h}</th>" for h in head)
            + f"</tr></thead><tbody>{''.join(rows)}</tbody></table>")


def config_table(models: list[RunModel]) -> str:
    """Every run's config.json side by side, nested keys flattened, under the title of each
    option group: the groups every algorithm reads, those of the runs' algorithms, and the
    options of other algorithms a run changed; the other algorithms' options left at their
    defaults are folded away below. Rows that differ between runs are marked."""
    flat = [_yours(_flatten(m.config)) for m in models]
    if not any(flat):
        return (f'<table class="grid"><tbody><tr><td colspan="{len(models) + 1}">no config.json'
                "</td></tr></tbody></table>")
    head = "".join(f"<th>{html.escape(m.name)}</th>" for m in models)
    shown, folded = _config_sections(models, flat)
    table = (f'<table class="grid config"><thead><tr><th></th>{head}</tr></thead><tbody>'
             + "".join(_config_rows(title, keys, flat) for title, keys in shown)
             + "</tbody></table>")
    if folded:
        table += (f"<details><summary>{len(folded)} options of other algorithms, at their "
                  f'defaults</summary><table class="grid config"><tbody>'
                  f"{_config_rows('', folded, flat)}</tbody></table></details>")
    return table


YOUR_LOOP = "set by your loop"  # a lowband.Sync run's cell of an option its own loop decides


def _yours(flat: dict) -> dict:
    """A run's flattened config; where a lowband.Sync run's loop decided an option (its
    `meta.your_loop`: the model, data, learning rate and schedule, the evaluation), that
    option's cell says so instead of `lowband train`'s default, which that loop never used."""
    owned = flat.pop("meta.your_loop", None) or ()
    return {k: YOUR_LOOP if k in owned else v for k, v in flat.items()}


def _config_sections(models: list[RunModel], flat: list[dict]) -> tuple[list, list]:
    """([(group title, keys shown)], the keys folded away): an option group's keys in its
    declared order, the keys of no group (the run's measurements, `meta`) last."""
    from lowband.algorithms import ALGORITHMS
    from lowband.config import COMMON_GROUPS, GROUPS, fields

    default = {f.name: f.default for f in fields()}
    read = set(COMMON_GROUPS)
    for m in models:
        algo = m.config.get("algo")
        read.update(ALGORITHMS[algo].options if algo in ALGORITHMS else GROUPS)
    shown, folded, placed = [], [], set()
    for group in GROUPS:
        names = [n for n in group.names() if any(n in f for f in flat)]
        placed.update(names)
        if group not in read:
            changed = [n for n in names if any(f.get(n, default[n]) != default[n] for f in flat)]
            folded += [n for n in names if n not in changed]
            names = changed
        if names:
            shown.append((group.title, names))
    rest = [k for k in dict.fromkeys(k for f in flat for k in f) if k not in placed]
    if rest:
        shown.append(("recorded by the run", rest))
    return shown, folded


def _config_rows(title: str, keys: list[str], flat: list[dict]) -> str:
    rows = [f'<tr class="group"><th colspan="{len(flat) + 1}">{html.escape(title)}</th></tr>'
            if title else ""]
    for k in keys:
        values = [f.get(k) for f in flat]
        differs = len(flat) > 1 and len({json.dumps(v, sort_keys=True) for v in values}) > 1
        cls = ' class="diff"' if differs else ""
        rows.append(f"<tr{cls}><th>{html.escape(k)}</th>"
                    + "".join(f"<td>{_cell(v)}</td>" for v in values) + "</tr>")
    return "".join(rows)


# summary.json's nested fields shown as rows of their own: their rows and how a cell reads
NESTED = {"elastic": (ELASTIC_ROWS, elastic_text), "target": (TARGET_ROWS, target_text)}
