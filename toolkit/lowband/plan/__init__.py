"""How much bandwidth does a run need? A schedule simulator of one training run on a slow link.

The model follows the compute-utilization simulations of Streaming DiLoCo (arXiv 2501.18512):
a step is a forward pass (1/3 of the step time) and a backward pass (2/3); every transfer over
the outer (slow) link queues first in, first out on one link of a bandwidth (bit/s) and a
latency (s per transfer). The timeline is event-driven: only steps that send or wait are
visited. docs/plan.md states the model, its assumptions and its formulas.

    from lowband.plan import simulate, required_bandwidth, plan
    simulate("streaming", params=1e9, layers=24, step_time=0.1, sync_every=100, fragments=8,
             overlap=1, codec="fp4-e3m0", bandwidth="1gbit").cu

    plan_configs(lowband.recipes.get("main").config(), step_time=0.05)  # a lowband Config

Each algorithm declares what it sends (its class's outer_link, comm/sends.py). inputs.py
(presets, codecs, parsing, validation, a Config's Run), timeline.py (the replay), api.py
(simulate, required_bandwidth, plan, plan_configs, plan_config, figure), check.py (against a
finished run), calibrate.py (lowband compare's measured tokens factors, --calibrate), cli.py
(main: lowband train's options).
"""

from lowband.plan.api import (SimResult, figure, plan, plan_config, plan_configs,
                              required_bandwidth, simulate)
from lowband.plan.check import check_run, measured_figure, predict_to_target
from lowband.plan.cli import main, run_plan, table
from lowband.plan.inputs import (ALGORITHMS, CODECS, GRAD_DTYPES, MODELS,
                                 PlanError, Run, exchange_phases, make_run, modeled,
                                 parse_bandwidth, payload_bytes, run_of)

__all__ = ["ALGORITHMS", "CODECS", "GRAD_DTYPES", "MODELS", "PlanError", "Run",
           "SimResult", "check_run", "exchange_phases", "figure", "main", "make_run",
           "measured_figure", "modeled", "parse_bandwidth", "payload_bytes", "plan", "plan_config",
           "plan_configs", "predict_to_target", "required_bandwidth", "run_of", "run_plan", "simulate", "table"]
