"""The plan against a finished run: predicted compute utilization beside the measured one.

The run's own compute time per step (the mean over ranks and steps of the `step` events'
compute_s, the first steps left out as warm-up) is the simulator's step time; the rest comes
from the run's config.json: algorithm, parameters, H, P, tau, codec, bucket size and the
emulated link. Only runs on an emulated link (or none) can be checked: the simulator knows the
link's bandwidth from --link-bandwidth.
"""

from __future__ import annotations

import statistics

from lowband.plan.api import plan_config
from lowband.plan.inputs import PlanError
from lowband.telemetry import RunDir, read_events


def check_run(run_dir, warmup_steps: int = 3) -> dict:
    run = RunDir(run_dir)
    config, summary = run.read_json(run.config), run.read_json(run.summary)
    if config is None or summary is None:
        raise PlanError(f"'{run_dir}' is not a finished lowband run (no config.json or "
                        "summary.json): give a run directory whose training ended.")
    steps = [e for e in read_events(run, ("step",)) if e["step"] > warmup_steps]
    if not steps:
        raise PlanError(f"'{run_dir}' has no step events after the first {warmup_steps} steps.")
    step_time = statistics.fmean(e["compute_s"] for e in steps)
    cfg = {k: v for k, v in config.items() if k != "meta"}
    predicted = plan_config(cfg, step_time=step_time, params=config["meta"]["n_params"])
    return {"run_dir": str(run.root), "algorithm": cfg["algo"], "step_time": step_time,
            "bandwidth": cfg.get("link_bandwidth") or "unlimited",
            "measured_cu": summary["compute_utilization"], "predicted_cu": predicted["cu"]}
