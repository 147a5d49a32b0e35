"""A comparison's table: per run, what reaching the target took, its validation loss at equal
time, its compute utilization measured and planned (and its least busy replica's), its
heterogeneity set-up (--straggler, --slowdown, --pause, --local-steps) and its tokens/s.

Everything is read from the finished runs' directories, so the target can be chosen after
they ran (the reference's final validation loss is known only then): each run's evaluations
are rebuilt from its `eval` events as the trainer keeps them for summary.json's `target`
([step, val_loss (mean over replicas), elapsed_s, tokens, outer_bytes], only those every rank
took), and lowband.summary.target reads them as it reads them there.

The terminal's text (text) names the target, fits its table into 100 columns and ends with one
line (target_answer) saying which run reached the target soonest, or that runs tied: reached it
less than an evaluation interval apart (target_eval_interval_s, each row's).
"""

from __future__ import annotations

import math
import textwrap

from lowband.dashboard.comparison import cell
from lowband.dashboard.model import RunModel
from lowband.dashboard.replicas import setup_text
from lowband.dashboard.style import fmt_value
from lowband.dashboard.tables import measured_text
from lowband.summary import target
from lowband.telemetry import RunDir, read_events


def evaluations(run_dir) -> list[list]:
    """A run's evaluations every rank took, in step order: [step, val_loss, elapsed_s, tokens,
    outer_bytes], val_loss the mean over replicas (each replica's first rank, in rank order, as
    ledger.py averages it)."""
    run = RunDir(run_dir)
    shards = (run.read_json(run.config) or {}).get("shards", 1) or 1
    by_step: dict[int, dict[int, dict]] = {}
    for e in read_events(run, ("eval",)):
        if "tokens" in e and "outer_bytes" in e:  # an evaluation every rank took
            by_step.setdefault(e["step"], {})[e["rank"]] = e
    out = []
    for step in sorted(by_step):
        ranks = by_step[step]
        first = ranks[min(ranks)]
        vals = [ranks[r]["val_loss"] for r in sorted(ranks) if r % shards == 0]
        out.append([step, sum(vals) / len(vals) if vals else math.nan, first["elapsed_s"],
                    first["tokens"], first["outer_bytes"]])
    return out


def loss_at(evals: list[list], t: float) -> float | None:
    """The validation loss at t seconds of training, linear between the evaluations around it;
    None before the first evaluation (or for a run without any)."""
    points = [(e[2], e[1]) for e in evals if math.isfinite(e[1])]
    if not points or t < points[0][0]:
        return None
    for (t0, v0), (t1, v1) in zip(points, points[1:]):
        if t0 <= t <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    return points[-1][1]  # at (or, by rounding, just past) its last evaluation


def planned(run_dir, tokens: float | None, link: str | None = None) -> dict:
    """What lowband.plan says of the finished run (its config and measured compute time a
    step): compute utilization measured and planned (check_run), and, given the tokens ddp
    took to the target, the planned seconds to it (predict_to_target: those tokens times what
    the published loss figures say the run's setup needs more, at its planned tokens/s). link:
    the bandwidth of the real link it ran over (test hosts), else its emulated one's. None where
    the plan cannot read the run or no figure applies."""
    from lowband.plan import PlanError, check_run, predict_to_target
    from lowband.plan.check import measured

    try:
        taken = measured(run_dir, link=link)  # the run's events, read once for both
        c = check_run(run_dir, taken=taken)
        p = predict_to_target(run_dir, tokens, taken=taken) if tokens else {}
    except (PlanError, KeyError, ValueError):
        return {"measured": None, "cu": None, "seconds": None, "fit": None}
    return {"measured": c["measured_cu"], "cu": c["predicted_cu"], "seconds": p.get("seconds"),
            "fit": p.get("fit")}


def replicas(run_dir) -> dict:
    """A run's heterogeneity set-up in its flags ("" for replicas alike) and each replica's
    compute utilization from its events (the report's replicas table), with the least busy
    replica: under fixed local steps the fast one, waiting for a straggler at every sync."""
    model = RunModel(run_dir).load()
    cu = [w.utilization for w in model.replica_work()]
    known = [(u, i) for i, u in enumerate(cu) if u is not None]
    low, which = min(known) if known else (None, None)
    return {"heterogeneity": setup_text(model.config), "replica_compute_utilization": cu,
            "lowest_replica_compute_utilization": low, "lowest_replica": which}


def rows(runs: list[tuple[str, str, dict]], loss: float, reference: str,
         link: str | None = None) -> tuple[list[dict], float | None]:
    """The table's rows for [(label, run directory, what the run was given)] with the target
    `loss`, and the equal time: the shortest run's training seconds (its last evaluation).
    Where the reference is a ddp run that reached the target, each row has the plan's time to
    it too. link: the real link's bandwidth (test hosts), where the runs had no emulated one."""
    evals = {label: evaluations(d) for label, d, _ in runs}
    ends = [e[-1][2] for e in evals.values() if e]
    equal_s = min(ends) if ends else None
    ref = dict((label, d) for label, d, _ in runs)[reference]
    ref_target = target(evals[reference], loss)
    ddp_tokens = ref_target.get("tokens") if ref_target["reached"] and \
        (RunDir(ref).read_json(RunDir(ref).config) or {}).get("algo") == "ddp" else None
    out = []
    for label, d, given in runs:
        run = RunDir(d)
        s = run.read_json(run.summary) or {}
        plan = planned(d, ddp_tokens, link)
        reached = target(evals[label], loss)
        measured = reached.get("elapsed_s") if reached["reached"] else None
        out.append({
            "name": label, "algorithm": s.get("algorithm"), "run_dir": str(d), "given": given,
            "target": reached,
            "val_loss_at_equal_time": None if equal_s is None else loss_at(evals[label], equal_s),
            "final_val_loss": s.get("final_val_loss"), "wall_s": s.get("wall_s"),
            "steps_run": s.get("steps_run"), "tokens": s.get("tokens"),
            "tokens_per_s": s.get("tokens_per_s"), "outer_wire_bytes": s.get("outer_wire_bytes"),
            "compute_utilization": s.get("compute_utilization") if plan["measured"] is None
            else plan["measured"], "planned_compute_utilization": plan["cu"],
            "planned_time_to_target_s": plan["seconds"], "planned_fit": plan["fit"],
            "planned_error": plan["seconds"] / measured - 1 if plan["seconds"] and measured
            else None, "target_eval_interval_s": eval_interval(evals[label], reached),
            **replicas(d)})
    return out, equal_s


def eval_interval(evals: list[list], reached: dict) -> float | None:
    """The seconds between the evaluation that reached the target and the one before it (the
    start, for the first): the run crossed the target somewhere in them. None if not reached."""
    if not reached.get("reached"):
        return None
    times = [e[2] for e in evals if e[0] <= reached["step"]]
    return times[-1] - (times[-2] if len(times) > 1 else 0.0)


WIDTH = 100  # the terminal's table fits this many columns; compare.json and the report hold all
TERMINAL = [("target.elapsed_s", "time to", "target"), ("planned_time_to_target_s", "planned",
            "time"), ("target.tokens", "tokens to", "target"), ("target.outer_bytes", "bytes to",
            "target"), ("val_loss_at_equal_time", "loss at", "equal time"),
            ("compute_utilization", "CU", "measured"), ("planned_compute_utilization", "CU",
            "planned"), ("tokens_per_s", "", "tokens/s")]
WORDS = ("name", "algorithm", "heterogeneity")  # left-aligned
UNEVEN = [("heterogeneity", "replicas", "differ"),  # where some run's replicas differ
          ("lowest_replica_compute_utilization", "CU least", "busy replica")]


def text(result: dict) -> str:
    """The comparison as the terminal shows it: the target (and a measured link, --link FILE),
    the table (a line per run, in two tables where one would be wider than WIDTH) and a line
    answering which run reached the target soonest (target_answer)."""
    runs = result["runs"]
    cols = [("name", "", "run")]
    if any(not r["name"].startswith(str(r.get("algorithm"))) for r in runs):
        cols.append(("algorithm", "", "algorithm"))  # where the names do not say it
    cols += TERMINAL + (UNEVEN if any(r.get("heterogeneity") for r in runs) else [])
    grid = {key: [top, label, *(_cell(key, r, result) for r in runs)] for key, top, label in cols}
    width = {key: max(map(len, column)) for key, column in grid.items()}
    tables, keys = [], ["name"]
    for key, *_ in cols[1:]:
        if sum(width[k] + 2 for k in keys) + width[key] > WIDTH:
            tables.append(keys)
            keys = ["name"]
        keys.append(key)
    at = result.get("equal_time_s")
    lines = textwrap.wrap(f"target: validation loss {fmt_value('loss', result.get('target_loss'))}"
                          f" ({str(result.get('target_from')).removesuffix(' validation loss')})"
                          + ("" if at is None else f"; equal time: {fmt_value('wall_s', at)} of "
                             "training, the shortest run's"), WIDTH)
    measured = (result.get("link") or {}).get("measured")
    if measured:  # --link FILE: the comparison's link, measured by lowband doctor
        lines += textwrap.wrap(f"link: {measured_text(measured)}", WIDTH)
    for keys in [*tables, keys]:
        lines += [""] + ["  ".join(grid[k][i].ljust(width[k]) if k in WORDS else
                                   grid[k][i].rjust(width[k]) for k in keys).rstrip()
                         for i in range(len(runs) + 2)]
    return "\n".join(lines + [""] + textwrap.wrap(target_answer(result), WIDTH))


def _cell(key: str, row: dict, result: dict) -> str:
    """The terminal's cell: the report's (dashboard/comparison.py's), shorter; at most 60
    characters (a run's name 24), so that a table of a name and one column fits WIDTH."""
    if key == "name":
        shown = row["name"]
    elif key == "target.elapsed_s" and not (row.get("target") or {}).get("reached"):
        shown = "not reached"
    else:
        shown = cell(key, row, result)
    most = 24 if key == "name" else 60
    return shown if len(shown) <= most else shown[:most - 1] + "…"


def target_answer(result: dict) -> str:
    """One line: the run that reached the target soonest and how much sooner than the reference
    (or, where the reference is that run or did not reach it, the next run); runs whose times
    to the target differ by less than the slower one's evaluation interval there
    (target_eval_interval_s) reached it "within one evaluation", a tie."""
    runs, loss = result["runs"], fmt_value("loss", result.get("target_loss"))

    def took(r: dict) -> float:
        return r["target"]["elapsed_s"]

    reached = sorted((r for r in runs if (r.get("target") or {}).get("reached")), key=took)
    if not reached:
        at = [r for r in runs if isinstance(r.get("val_loss_at_equal_time"), (int, float))]
        best = min(at, key=lambda r: r["val_loss_at_equal_time"]) if at else None
        return f"no run reached {loss}" + ("." if best is None else (
            f"; the lowest validation loss at equal time: {best['name']}'s "
            f"{fmt_value('loss', best['val_loss_at_equal_time'])}."))
    lead = reached[0]
    tied = [lead] + [r for r in reached[1:] if r.get("target_eval_interval_s") is not None
                     and took(r) - took(lead) < r["target_eval_interval_s"]]
    later = [r for r in reached if r not in tied]
    other = next((r for r in later if r["name"] == result.get("reference")), None)
    other = other or (later[0] if later else None)
    t = lambda r: fmt_value("wall_s", took(r))  # noqa: E731
    if len(tied) == 1:
        said = f"{lead['name']} reached {loss} in {t(lead)}"
    else:
        names = ", ".join(r["name"] for r in tied[:-1]) + f" and {tied[-1]['name']}"
        said = (f"{names} reached {loss} within one evaluation "
                f"({', '.join(t(r) for r in tied)})")
    if other is not None and took(lead) > 0:
        x = took(other) / took(lead)
        said += f", {x:.2f}x" if x < 1.1 else f", {x:.1f}x" if x < 10 else f", {x:.0f}x"
        said += f" sooner than {other['name']} ({t(other)})"
    elif len(reached) < len(runs):
        said += "; the other runs did not reach it"
    return said + "."
