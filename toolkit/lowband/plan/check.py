"""The plan against a finished run: predicted compute utilization beside the measured one.

The run's own compute time per step (the mean over ranks and steps of the `step` events'
compute_s, the first steps left out as warm-up, each over its replica's --straggler factor)
is the simulator's step time; the rest is the
run's config.json, read as `lowband plan --config RUN` reads it (plan_config). A run on an
emulated link is simulated on that link, a run without one on an unlimited link.
"""

from __future__ import annotations

import dataclasses
import statistics

from lowband.faults import parse_straggler
from lowband.plan.api import _simulate, config_of, curves, plan, plan_config
from lowband.plan.inputs import PlanError, fmt_bandwidth, run_of
from lowband.plan.target import timing
from lowband.telemetry import RunDir, read_events


def measured(run_dir, warmup_steps: int = 3, link: str | None = None
             ) -> tuple[dict, dict, dict]:
    """(config without meta but for its measured link, summary, what the plan takes from the
    run: its mean compute seconds per step, its parameters, the steps it ran (acco's budget
    makes fewer, larger steps than --steps; aedit's replicas their own counts: their mean), and
    an unlimited link if it had no emulated one) of a finished run; PlanError naming the fix
    otherwise. link: the bandwidth of the real link the run went over (lowband compare's test
    hosts), planned as its link."""
    run = RunDir(run_dir)
    config, summary = run.read_json(run.config), run.read_json(run.summary)
    if config is None or summary is None:
        raise PlanError(f"'{run_dir}' is not a finished lowband run (no config.json or "
                        "summary.json): give a run directory whose training ended.")
    steps = [e for e in read_events(run, ("step",)) if e["step"] > warmup_steps]
    if not steps:
        raise PlanError(f"'{run_dir}' has no step events after the first {warmup_steps} steps.")
    cfg = {k: v for k, v in config.items() if k != "meta"}
    if (config.get("meta") or {}).get("link"):  # its measured link, kept (config_of)
        cfg["meta"] = {"link": config["meta"]["link"]}
    # a straggler's sleep counts as its compute: the plan's step time is the unslowed one
    slow = parse_straggler(cfg.get("straggler") or "", cfg.get("replicas") or 1)
    took = {"step_time": statistics.fmean(e["compute_s"] / slow.get(e.get("replica"), 1.0)
                                          for e in steps),
            "params": config["meta"]["n_params"], "steps": max(1, round(summary["steps_run"]))}
    if link:
        cfg["link_bandwidth"] = link
    return cfg, summary, took | ({} if cfg.get("link_bandwidth") else {"bandwidth": "inf"})


def check_run(run_dir, warmup_steps: int = 3, link: str | None = None, *, taken=None,
              predicted=None) -> dict:
    """The run's measured compute utilization beside the plan's for its config and measured step
    time, and its largest transfer over the outer link (wire bytes of one collective) beside the
    plan's. warmup_steps=0 takes every step's compute, so the plan computes as long as the run.
    link: as measured()'s; taken: measured(run_dir, warmup_steps, link) where the caller has it
    already; predicted: the plan of exactly that (plan_config(cfg, **took): its `cu` and
    `peak_transfer_bytes`), likewise."""
    cfg, summary, took = taken or measured(run_dir, warmup_steps, link)
    predicted = predicted or plan_config(cfg, **took)
    sent = [e["wire_bytes"] for e in read_events(RunDir(run_dir), ("comm",))
            if e["group"] == "outer"]
    return {"run_dir": str(run_dir), "algorithm": cfg["algo"], "step_time": took["step_time"],
            "bandwidth": cfg.get("link_bandwidth") or "unlimited",
            "measured_cu": summary["compute_utilization"], "predicted_cu": predicted["cu"],
            "sent_peak_transfer_bytes": max(sent, default=0),
            "planned_peak_transfer_bytes": predicted["peak_transfer_bytes"]}


def predict_to_target(run_dir, tokens: float, warmup_steps: int = 3,
                      link: str | None = None, *, taken=None) -> dict:
    """The plan's time for a finished run's setup to reach the loss another run (ddp's) reached
    after `tokens` tokens: those tokens times the tokens its loss at equal tokens costs
    (plan/loss.py), at its planned tokens/s (its measured compute a step, its planned CU).
    seconds is None where no published figure applies to its algorithm. link: as measured()'s;
    taken: measured(run_dir, warmup_steps, link) where the caller has it already."""
    cfg, _, took = taken or measured(run_dir, warmup_steps, link)
    c = config_of(cfg)
    run = run_of(c, **took)  # its own row only: no ddp variant, no recommendation
    row = plan(algorithms=(c.algo,), run=run)["algorithms"][c.algo]
    row |= timing(c, run, row)
    fit = row.get("loss_penalty")
    seconds = None if fit is None or not row.get("tokens_per_s") else \
        tokens * fit["tokens_factor"] / row["tokens_per_s"]
    return {"seconds": seconds, "tokens_per_s": row.get("tokens_per_s"),
            "tokens_factor": None if fit is None else fit["tokens_factor"],
            "fit": None if fit is None else fit["fit"]}


def measured_figure(run_dirs, warmup_steps: int = 3):
    """lowband plan's CU-against-bandwidth curve of each run on an emulated link (its own config
    and measured step time; runs that differ only in their link share one), its planned CU at
    its link as a circle and its measured one as a diamond; None when no run had a link."""
    lines, points = {}, []
    for r in run_dirs:
        cfg, summary, took = measured(r, warmup_steps)
        if not cfg.get("link_bandwidth"):
            continue
        run = run_of(config_of(cfg), **took)
        name = str(r).rstrip("/").split("/")[-1]
        key = (cfg["algo"], dataclasses.replace(run, bandwidth=None))
        lines.setdefault(key, (f"{cfg['algo']} planned", cfg["algo"], run))
        planned = _simulate(cfg["algo"], run, run.bandwidth).cu
        points.append((name, cfg["algo"], run.bandwidth, planned, summary["compute_utilization"]))
    if not points:
        return None
    fig = curves(list(lines.values()), links=[bits for _, _, bits, _, _ in points])
    for name, algo, bits, planned, cu in points:
        for what, y, symbol in (("planned", planned, "circle-open"), ("measured", cu, "diamond")):
            fig.add_scatter(x=[bits], y=[y], mode="markers", marker=dict(size=11, symbol=symbol),
                            name=f"{algo} {what} ({name}, {fmt_bandwidth(bits)})")
    return fig
