"""The report's section of a `lowband compare` (lowband/compare/): its table, a row per run,
and the terminal's table from the same cells.

A comparison's result is a dict (compare.json's): `runs` (rows with `name`, `algorithm`,
`target` as summary.json's, `planned_time_to_target_s`, `val_loss_at_equal_time`,
`compute_utilization`, `planned_compute_utilization`, `tokens_per_s`, `final_val_loss`,
`wall_s`, `heterogeneity` (its --straggler and --local-steps),
`lowest_replica_compute_utilization` and `lowest_replica`), `target_loss`, `target_from`,
`equal` (time or tokens), `equal_time_s` and `reference` (a run's name).
"""

from __future__ import annotations

import html

from .style import fmt_value
from .tables import measured_text, target_text

COLUMNS = [("name", "run"), ("algorithm", "algorithm"), ("heterogeneity", "replicas differ"),
           ("target.elapsed_s", "time to target"),
           ("planned_time_to_target_s", "planned"), ("planned_error", "planned error"),
           ("target.tokens", "tokens to target"), ("target.outer_bytes", "outer bytes to target"),
           ("val_loss_at_equal_time", "val loss at equal time"),
           ("compute_utilization", "CU measured"),
           ("lowest_replica_compute_utilization", "CU least busy replica"),
           ("planned_compute_utilization", "CU planned"),
           ("tokens_per_s", "tokens/s"), ("final_val_loss", "final val loss"),
           ("wall_s", "training time")]


def cell(key: str, row: dict, result: dict) -> str:
    """One cell as text: "not reached (best 3.4100)" where the target was not reached."""
    if key.startswith("target."):
        return target_text(key, row.get("target"))
    if key == "name":
        return row["name"] + (" (reference)" if row["name"] == result.get("reference") else "")
    if key == "heterogeneity":
        return row.get(key) or "–"
    if key == "lowest_replica_compute_utilization" and row.get("lowest_replica") is not None:
        return f"{fmt_value('compute_utilization', row[key])} (replica {row['lowest_replica']})"
    as_ = {"planned_compute_utilization": "compute_utilization",
           "lowest_replica_compute_utilization": "compute_utilization",
           "val_loss_at_equal_time": "loss"}.get(key, key)  # formatted as these
    return fmt_value(as_, row.get(key))


def note(result: dict) -> str:
    """What the table's runs were given and measured against, in a sentence or two."""
    equal = result.get("equal")
    given = (f"Each run had the same {fmt_value('wall_s', result.get('budget_s'))} of training"
             if equal == "time" else "Each run trained on the reference's tokens")
    at = result.get("equal_time_s")
    link = result.get("link") or {}
    if link.get("test_hosts"):
        given += (f", over test hosts joined by a real link shaped to {link.get('bandwidth')} "
                  "(tc tbf; no latency added)")
    elif link.get("bandwidth"):
        given += (f", over the emulated link ({link['bandwidth']}, {link.get('latency')} "
                  "latency)")
    if link.get("measured"):  # --link FILE: the link it emulates, or the hosts are shaped to
        given += f", the link {measured_text(link['measured'])}"
    return (f"{given}; target validation loss {fmt_value('loss', result.get('target_loss'))} "
            f"({result.get('target_from')}); validation loss at equal time: at "
            f"{fmt_value('wall_s', at)} of training, the shortest run's end, linear between "
            "evaluations; planned: the time to target lowband plan predicts for the run's config "
            "and measured compute time (ddp's tokens to target, times what the published loss "
            "figures say its setup needs more, at its planned tokens/s; – where no figure "
            "applies), and its error against the measured time; replicas differ: the run's "
            "--straggler and --local-steps; CU: compute utilization, measured (the mean over "
            "ranks, and the least busy replica's: its compute seconds over its training "
            "seconds) and as lowband plan predicts it.")


def compare_section(result: dict) -> str:
    """The report's #compare section."""
    head = "".join(f"<th>{html.escape(label)}</th>" for _, label in COLUMNS)
    body = "".join("<tr>" + "".join(f'<td data-key="{key}">{html.escape(cell(key, row, result))}'
                                    "</td>" for key, _ in COLUMNS) + "</tr>"
                   for row in result.get("runs", []))
    return ('<section id="compare"><h2>Which run reached the target soonest</h2>'
            f'<p class="meta">{html.escape(note(result))}</p><div class="scroll">'
            f'<table class="grid compare"><thead><tr>{head}</tr></thead><tbody>{body}</tbody>'
            "</table></div><style>table.grid.compare td:first-child{text-align:left}</style>"
            "</section>")
