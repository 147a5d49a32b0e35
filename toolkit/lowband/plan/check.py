"""The plan against a finished run: predicted compute utilization beside the measured one.

The run's own compute time per step (the mean over ranks and steps of the `step` events'
compute_s, the first steps left out as warm-up) is the simulator's step time; the rest comes
from the run's config.json: algorithm, parameters, H, P, tau, codec, bucket size and the
emulated link. Only runs on an emulated link (or none) can be checked: the simulator knows the
link's bandwidth from --link-bandwidth.
"""

from __future__ import annotations

import statistics

from lowband.plan.api import config_inputs, figure, plan_config
from lowband.plan.inputs import PlanError
from lowband.units import parse_bandwidth
from lowband.telemetry import RunDir, read_events


def _measured(run_dir, warmup_steps: int) -> tuple[dict, dict, float]:
    """(config without meta + n_params as params, summary, mean compute seconds per step)."""
    run = RunDir(run_dir)
    config, summary = run.read_json(run.config), run.read_json(run.summary)
    if config is None or summary is None:
        raise PlanError(f"'{run_dir}' is not a finished lowband run (no config.json or "
                        "summary.json): give a run directory whose training ended.")
    steps = [e for e in read_events(run, ("step",)) if e["step"] > warmup_steps]
    if not steps:
        raise PlanError(f"'{run_dir}' has no step events after the first {warmup_steps} steps.")
    cfg = {k: v for k, v in config.items() if k != "meta"}
    cfg["params"] = config["meta"]["n_params"]
    return cfg, summary, statistics.fmean(e["compute_s"] for e in steps)


def check_run(run_dir, warmup_steps: int = 3) -> dict:
    """The run's measured compute utilization beside the plan's for its config and measured step
    time, and its largest transfer over the outer link (wire bytes of one collective) beside the
    plan's. warmup_steps=0 takes every step's compute, so the plan computes as long as the run."""
    cfg, summary, step_time = _measured(run_dir, warmup_steps)
    predicted = plan_config(cfg, step_time=step_time)
    sent = [e["wire_bytes"] for e in read_events(RunDir(run_dir), ("comm",))
            if e["group"] == "outer"]
    return {"run_dir": str(run_dir), "algorithm": cfg["algo"], "step_time": step_time,
            "bandwidth": cfg.get("link_bandwidth") or "unlimited",
            "measured_cu": summary["compute_utilization"], "predicted_cu": predicted["cu"],
            "sent_peak_transfer_bytes": max(sent, default=0),
            "planned_peak_transfer_bytes": predicted["peak_transfer_bytes"]}


def measured_figure(run_dirs, algorithms=("ddp", "diloco", "streaming"), warmup_steps: int = 3):
    """lowband plan's CU-against-bandwidth curves for the first run's model and step time, with
    every run on an emulated link drawn as a measured point; None when no run had one."""
    runs = [(str(r), *_measured(r, warmup_steps)) for r in run_dirs]
    linked = [r for r in runs if r[1].get("link_bandwidth")]
    if not linked:
        return None
    _, cfg, _, step_time = linked[0]
    streaming = next((c for _, c, _, _ in runs if c["algo"] == "streaming"), {})
    base = {**cfg, **{k: streaming[k] for k in ("sync_every", "fragments", "overlap", "codec")
                      if k in streaming}, "algo": "streaming"}
    _, kw = config_inputs(base, step_time=step_time)
    kw.pop("bandwidth")
    fig = figure(algorithms=algorithms, **kw)
    for name, c, summary, _ in linked:
        bits = parse_bandwidth(c["link_bandwidth"])
        fig.add_scatter(x=[bits], y=[summary["compute_utilization"]], mode="markers",
                        marker=dict(size=11, symbol="diamond"),
                        name=f"{c['algo']} measured ({name.rstrip('/').split('/')[-1]})")
    return fig
