"""`lowband plan`: lowband train's options (the same names, defaults, --recipe and --config, from
the same option groups) plus what the plan needs to know of the machine; a table per algorithm
for people, --json for scripts; bad input exits 2 with one sentence."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from lowband.comm.link import describe_measured
from lowband.flags import config_of_args, train_parser
from lowband.plan.api import config_of, plan_configs
from lowband.plan import probe
from lowband.plan.calibrate import reads
from lowband.plan.check import check_run, measured
from lowband.plan.inputs import (PlanError, _number, fmt_bandwidth, fmt_bytes, fmt_count,
                                  fmt_seconds, modeled)

EXAMPLE = ("lowband plan --recipe main --step-time 50ms; lowband plan --config RUN_DIR; "
           "lowband plan --params 1e9 --n-layer 24 --step-time 0.1 --algo streaming "
           "--sync-every 100 --fragments 8 --link-bandwidth 1gbit")
# the plan's own flags, with their defaults (the rest are lowband train's)
OWN = {"step_time": None, "flops_per_step": None, "flops": None, "params": None,
       "target_cu": "0.9", "compare": "all", "steady": False, "calibrate": None, "json": False}
# the options a row shows, where its algorithm reads them (H comes from its schedule)
SHOWN = (("fragments", "P={}"), ("overlap", "tau={}"), ("codec", "{}"))


def _parser() -> argparse.ArgumentParser:
    p = train_parser(prog="lowband plan", resume=False, description=(
        "How much bandwidth does a run need, and what compute utilization does it reach on its "
        "link? Takes lowband train's options (a run as `lowband train` would start it) and the "
        "compute time of a step, and simulates the schedule of the run's algorithm and, beside "
        "it, every other algorithm at its own defaults (docs/plan.md)."))
    p.epilog = f"examples: {EXAMPLE}"
    g = p.add_argument_group("plan options (the machine and the question, not lowband train's)")
    add = g.add_argument
    add("--step-time", help="compute seconds of one step on one rank, e.g. 0.1 or 100ms, or "
        "'probe': measured here, a few steps of the config's model on its device (with --config "
        "of a finished run: measured from its events)")
    add("--flops-per-step", help="FLOPs of one step (with --flops, instead of --step-time)")
    add("--flops", help="achieved FLOP/s of one rank")
    add("--params", help="a model of this many parameters (1e9, 1.3B) spread evenly over the "
        "blocks (--n-layer, or the model's), in place of --model's own count")
    add("--target-cu", help="compute utilization to reach (default 0.9)")
    add("--compare", help="the algorithms planned beside the config's: all (default), none, or "
        "names separated by commas")
    add("--steady", action="store_true", help="the steady state of a long run, instead of the "
        "whole run of --steps steps (its start and its last wait included)")
    add("--calibrate", metavar="DIR", help="a finished `lowband compare` directory (its "
        "compare.json) measured against ddp: rows with the setting of one of its runs that "
        "reached the target take its measured tokens to ddp's loss, in place of the published "
        "figures (docs/plan.md)")
    add("--json", action="store_true", help="print JSON for scripts instead of a table")
    return p


def _finished(path) -> Path | None:
    """The run directory --config names, when it holds a finished run."""
    if not path:
        return None
    run = Path(path).parent if Path(path).name == "config.json" else Path(path)
    return run if (run / "summary.json").exists() else None


def run_plan(argv: list[str]) -> tuple[dict, bool]:
    """(what `lowband plan --json ARGV` prints, whether --json was given); PlanError or
    ConfigError on bad input."""
    args = vars(_parser().parse_args(argv))
    own = {k: args.pop(k, default) for k, default in OWN.items()}
    for key in ("params", "flops_per_step", "flops"):  # named at once, not after a probe
        if own[key] is not None:
            _number(own[key], key.replace("_", "-"))
    finished = _finished(args.get("config"))
    cfg, _ = config_of_args(args, here=False, file_here=True)
    extra, taken, as_run = {}, None, False
    if finished is not None:  # its compute a step, parameters, steps, link (check.measured)
        taken = measured(finished)  # its events, read once: here and for check_run below
        took = dict(taken[2])
        # the config's own row is check_run's prediction when it plans the run as it ran
        as_run = not (own["step_time"] or own["params"] or own["steady"]
                      or own["flops_per_step"]) and \
            dataclasses.replace(config_of(taken[0]), run_dir=cfg.run_dir) == cfg
        for key in ("step_time", "params"):  # what was given over what was measured
            measured_value = took.pop(key)
            own[key] = own[key] or measured_value
        extra |= {k: v for k, v in took.items() if k == "bandwidth" or not own["steady"]}
    if own["flops_per_step"] is not None:
        extra |= {"flops_per_step": own["flops_per_step"], "flops": own["flops"]}
    if own["step_time"] == "probe":  # a few steps of the model here (plan/probe.py)
        own["step_time"] = probe.step_time(cfg)
    compare = own["compare"] or "all"
    names = (modeled() if compare == "all" else [] if compare == "none"
             else [n.strip() for n in compare.split(",") if n.strip()])
    result = plan_configs(cfg, names, own["target_cu"] or "0.9", step_time=own["step_time"],
                          params=own["params"], steady=own["steady"],
                          calibration=own["calibrate"], **extra)
    if cfg.measured_link:  # --link FILE, or the measured link a finished run recorded
        result["link"] = cfg.measured_link
    if taken is not None:
        row = result["algorithms"][cfg.algo]
        result["measured"] = check_run(finished, taken=taken,
                                       predicted=row if as_run and "error" not in row else None)
    if all("error" in row for row in result["algorithms"].values()):
        raise PlanError(result["algorithms"][cfg.algo]["error"])
    return result, own["json"]


def _setup(name: str, row: dict) -> str:
    """'every 20 steps, P=4 tau=1 fp4-e3m0': how often it syncs (its schedule's period, which
    the row carries) and the options it reads among P, tau and the codec."""
    every, inputs = row.get("sync_period_steps", 1), row["inputs"]
    parts = [form.format(inputs[key]) for key, form in SHOWN if key in reads(name)]
    pace = (row.get("per_replica") or {}).get("local_steps", "fixed")
    if pace != "fixed":  # adaptive, or declared speeds
        parts.append("steps " + pace)
    return " ".join([f"every {every} steps" if every > 1 else "every step", *parts])


def _slower(slowdowns) -> str:
    """'; replica 1 computes 2x slower': the --straggler set-up, for the header."""
    slow = [f"replica {r} {f:g}x" for r, f in enumerate(slowdowns or ()) if f != 1]
    return f"; slower compute: {', '.join(slow)} (--straggler)" if slow else ""


def _replica_notes(result: dict) -> list[str]:
    """Per row whose replicas differ: each replica's compute utilization (and its steps a sync
    with adaptive or declared steps); the row's CU is their mean."""
    lines = []
    for name, r in result["algorithms"].items():
        per = r.get("per_replica")
        if not per:
            continue
        cus = ", ".join(f"{u:.3f}" for u in per["utilization"])
        steps = per["steps_per_sync"]
        lines.append(f"{name}: CU by replica {cus} (the row's: their mean)" + (
            "" if steps is None else f"; inner steps a sync {', '.join(map(str, steps))}"))
    if lines:
        lines.insert(0, "")
        lines.append("replicas that differ: fixed steps wait for the slowest at every sync or "
                     "step; adaptive steps run fewer on a slow replica (docs/plan.md)")
    return lines


def _soon(r: dict) -> str:
    """'0.094x (11.3 s)': the time to the loss ddp's run ends at, against ddp's."""
    if r.get("vs_ddp") is None:
        return "no figure" if r.get("loss_penalty") is None and r.get("cu") is not None else "-"
    seconds = r.get("time_to_ddp_loss_s")
    return f"{r['vs_ddp']:.3g}x" + ("" if seconds is None else f" ({fmt_seconds(seconds)})")


def _fit_notes(fits: dict, recommended, algorithm: str, target: float) -> list[str]:
    """The figures the time to ddp's loss rests on, and the recommendation for the link."""
    lines = [""] + [f"to ddp's loss: ddp's tokens, times the tokens a higher loss at equal tokens "
                    f"costs, at each one's tokens/s; the loss from {fit}"
                    f"{'; ' + outside if outside else ''} (docs/plan.md)"
                    for fit, outside in fits.items()]
    if recommended and recommended.get("sync_every"):
        r = recommended
        lines.append(f"recommended for {algorithm} on this link: --sync-every {r['sync_every']} "
                     f"--codec {r['codec']} (CU {r['cu']:.3f} >= {target:g}; loss "
                     f"{r['loss_penalty']:+.2%} against ddp's at equal tokens, the least that "
                     "reaches it)")
    elif recommended:
        lines.append(f"no setting of {algorithm} reaches CU {target:g} on this link (tried "
                     f"{recommended['tried']})")
    return lines if len(lines) > 1 else []


def _calibration_notes(cal: dict | None) -> list[str]:
    """Which rows took a tokens factor measured by `lowband compare` (--calibrate), and which
    matched a compared run that did not reach the target."""
    if not cal:
        return []
    done = ", ".join(f"{name} (run {c['run']}: {c['tokens_factor']:.3g}x ddp's tokens)"
                     for name, c in cal["calibrated"].items())
    lines = ["", f"calibrated by lowband compare ({cal['dir']}, against {cal['reference']}): " + (
        f"to ddp's loss measured for {done}" if done else "no row has the setting of a run it "
        "compared (algorithm, R, parameters; H, P, tau, codec where read): the figures stand")]
    lines += [f"{name}: not reached in {cal['dir']} (its setting's run {run}): no measured "
              "factor" for name, run in cal["not_reached"].items()]
    return lines


def table(result: dict) -> str:
    """The human table of a run_plan() result: one row per algorithm, the config's first."""
    own, target = result["algorithms"][result["algorithm"]], result["target_cu"]
    i = own.get("inputs") or next(r["inputs"] for r in result["algorithms"].values() if "inputs" in r)
    link = {None: "none emulated (CU not shown)", "inf": "unlimited"}.get(i["bandwidth"])
    link = link or fmt_bandwidth(i["bandwidth"])
    run = "the steady state" if i["steps"] is None else f"a run of {i['steps']} steps"
    measured_link = result.get("link")
    where = measured_link and (measured_link.get("file") or "a measured link")
    lines = [f"{fmt_count(i['params'])} params, {i['layers']} blocks, step "
             f"{fmt_seconds(i['step_time'])}, R={i['replicas']} S={i['shards']}"
             f"{_slower(i.get('slowdowns'))}; link {link}, latency {fmt_seconds(i['latency'])}"
             + (f" (measured: {where})" if measured_link else "") + f"; {run}"]
    if measured_link:  # what the file says, of which the plan takes the slowest direction
        lines.append(f"{where}: {describe_measured(measured_link)}")
    lines.append("")
    rows = [("algorithm", "syncs", "CU", "stall/step", "wire/step", "largest transfer",
             f"needs for CU {target:g}", "tokens/s", "to ddp's loss")]
    notes, fits = [], {}
    calibrated = (result.get("calibration") or {}).get("calibrated", {})
    for name, r in result["algorithms"].items():
        label = name + (" (this config)" if name == result["algorithm"] else "")
        if "error" in r:
            notes.append(f"{name}: {r['error']}")
            rows.append((label, *["-"] * (len(rows[0]) - 1)))
            continue
        rows.append((label, _setup(name, r), "-" if r["cu"] is None else f"{r['cu']:.3f}",
                     fmt_seconds(r["stall_per_step"]), fmt_bytes(r["wire_bytes_per_step"]),
                     fmt_bytes(r["peak_transfer_bytes"]), fmt_bandwidth(r["required_bandwidth"]),
                     "-" if r["tokens_per_s"] is None else f"{fmt_count(r['tokens_per_s'])}",
                     _soon(r)))
        fit = r.get("loss_penalty")
        if fit and fit["loss"] and fit["fit"] not in fits and name not in calibrated:
            fits[fit["fit"]] = fit["outside"]
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines += _replica_notes(result)
    lines += _fit_notes(fits, result.get("recommended"), result["algorithm"], target)
    lines += _calibration_notes(result.get("calibration"))
    if "measured" in result:
        m = result["measured"]
        lines += ["", f"measured ({m['run_dir']}): CU {m['measured_cu']:.3f} against "
                  f"{m['predicted_cu']:.3f} planned; largest transfer "
                  f"{fmt_bytes(m['sent_peak_transfer_bytes'])} against "
                  f"{fmt_bytes(m['planned_peak_transfer_bytes'])} planned"]
    return "\n".join(lines + [""] + notes if notes else lines)


def newest_run(runs: Path = Path("runs")) -> Path | None:
    """The newest finished run under ./runs (where `lowband train` writes them), if any."""
    done = [s.parent for s in runs.glob("*/summary.json")]
    return max(done, key=lambda run: run.stat().st_mtime) if done else None


def main(argv: list[str] | None = None) -> int:
    """`lowband plan ...`: 0 on success; bad input raises a UserError (PlanError, ConfigError),
    which `lowband`'s handler (cli.py) prints as one sentence, exit status 2. Alone, `lowband
    plan` plans the main job with its step's compute probed here (said as such, on stderr), and
    ends with how to plan a finished run instead."""
    argv = sys.argv[1:] if argv is None else argv
    bare = not argv
    if bare:
        print(f"lowband plan: no --step-time given: probing the main job's step on this machine "
              f"({probe.WARMUP + probe.TIMED} steps of its model without communication, about "
              "a second)...", file=sys.stderr, flush=True)
        argv = ["--step-time", "probe"]
    try:
        result, as_json = run_plan(argv)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    try:
        print(json.dumps(result, indent=2) if as_json else table(result), flush=True)
        if bare:
            print(f"\nto plan from a finished run: lowband plan --config "
                  f"{newest_run() or 'runs/<run>'}", flush=True)
    except BrokenPipeError:  # `lowband plan ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0

