"""The Python API: simulate one algorithm, find the bandwidth a target needs, plan all (from
numbers, or from a lowband Config as `lowband train` takes it), draw."""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

from lowband.algorithms import ALGORITHMS as REGISTRY
from lowband.options import ConfigError, needs_extra
from lowband.plan import calibrate
from lowband.plan.inputs import (ALGORITHMS, GRAD_DTYPES, PlanError, Run, _number, fmt_bandwidth,
                                 fmt_count, make_run, modeled, payload_bytes, run_of)
from lowband.plan.replicas import join, replica_runs
from lowband.plan.target import recommend, timing, to_ddp_loss
from lowband.plan.timeline import Timeline, schedule, steady_stall

if TYPE_CHECKING:
    from lowband.config import Config


@dataclass
class SimResult:
    """One algorithm on one link. Times are totals over the simulated window of `steps` steps."""
    algorithm: str
    cu: float                    # compute / (compute + stall)
    compute_s: float
    stall_s: float
    steps: int
    step_time: float
    bandwidth: float
    latency: float
    wire_bytes_per_step: float   # sent by each replica over the slow link, on average
    transfers_per_step: float
    peak_transfer_bytes: float   # the largest single transfer
    peak_transfer_s: float       # its duration on this link, latency included
    sync_period_steps: int = 1   # its send pattern repeats every this many steps (H; 1: every step)
    per_replica: dict | None = None  # replicas that differ (replicas.join); None: all alike

    @property
    def stall_per_step(self) -> float:
        return self.stall_s / self.steps

    def to_dict(self) -> dict:
        out = asdict(self) | {"stall_per_step": self.stall_per_step}
        return out if self.per_replica else {k: v for k, v in out.items() if k != "per_replica"}


def simulate(algorithm: str, **params) -> SimResult:
    """CU of one algorithm: steady state by default, or the whole run when `steps` is given.

    params: make_run's arguments (params, layers, step_time, bandwidth, latency, ...)."""
    run = _run(params)
    if run.bandwidth is None:
        raise PlanError("give the link bandwidth with --bandwidth (e.g. 1gbit) to simulate a run.")
    return _simulate(algorithm, run, run.bandwidth)


def _run(params: dict) -> Run:
    """A Run passed as run=..., or one made from make_run's keyword arguments."""
    return params.pop("run") if "run" in params else make_run(**params)


def _simulate(algorithm: str, run: Run, bandwidth: float) -> SimResult:
    parts = replica_runs(algorithm, run)
    if parts is not None:  # replicas that differ: each at its own pace, joined (replicas.py)
        sims: dict = {}
        for sub, _ in parts:
            if sub not in sims:
                sims[sub] = _simulate(algorithm, sub, bandwidth)
        return join(algorithm, run, parts, [sims[sub] for sub, _ in parts])
    s = schedule(algorithm, run)
    if run.steps is None:  # the periodic regime after the transient
        units, stall = steady_stall(s, bandwidth, run.latency)
    else:  # the whole run, and the wait for what is still in flight after its last step
        units, timeline = run.steps * s.units_per_step, Timeline(s, bandwidth, run.latency)
        stall = timeline.run(units) + timeline.drain()
    compute = units * s.unit_s
    per_step = s.units_per_step / s.period  # each sending unit comes this often a step
    sizes = [send.nbytes for send in s.every()]
    peak = max(sizes, default=0.0)
    return SimResult(
        algorithm, compute / (compute + stall), compute, stall, round(compute / run.step_time),
        run.step_time, bandwidth, run.latency,
        wire_bytes_per_step=round(sum(sizes) * per_step, 3),
        transfers_per_step=len(sizes) * per_step, peak_transfer_bytes=round(peak, 3),
        peak_transfer_s=run.latency + peak * 8 / bandwidth if sizes else 0.0,
        sync_period_steps=s.period // s.units_per_step if s.units_per_step else 1)


def required_bandwidth(algorithm: str, target_cu: float = 0.9, **params) -> float | None:
    """The lowest bandwidth (bit/s) whose CU reaches target_cu; None when unreachable at any
    bandwidth (latency alone stalls too long), 0.0 when nothing crosses the link."""
    run = _run(params)
    return _required(algorithm, run, _target(target_cu))


def _target(target_cu) -> float:
    target = _number(target_cu, "target-cu")
    if not 0 < target <= 1:
        raise PlanError(f"--target-cu must lie in (0, 1], got {target_cu}.")
    return target


def _required(algorithm: str, run: Run, target: float) -> float | None:
    def ok(bw: float) -> bool:
        return _simulate(algorithm, run, bw).cu >= target

    if not schedule(algorithm, run).sends:
        return 0.0
    lo, hi = 1.0, 1e18
    if not ok(hi):
        return None
    if ok(lo):
        return lo
    while hi / lo > 1 + 1e-7:  # bisection on a log scale
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    rounded = _ceil_sig(hi, 5)  # readable, and still at or above the bisection's answer
    return rounded if ok(rounded) else hi


def _ceil_sig(x: float, digits: int) -> float:
    """x rounded up to `digits` significant digits."""
    e = digits - 1 - math.floor(math.log10(x))
    return math.ceil(x * 10**e) / 10**e if e >= 0 else float(math.ceil(x / 10**-e) * 10**-e)


# ----------------------------------------------------------------------------- plan, figure

def plan(target_cu: float = 0.9, algorithms=ALGORITHMS, **params) -> dict:
    """What `lowband plan --json` prints: the inputs, and per algorithm its CU on the given link
    (null without a bandwidth) and the lowest bandwidth reaching target_cu (null: unreachable)."""
    run, target = _run(params), _target(target_cu)
    inputs = asdict(run) | {
        "bandwidth": "inf" if run.bandwidth == math.inf else run.bandwidth,  # JSON has no inf
        "codec_bytes_per_value": payload_bytes(run, round(run.params)) / round(run.params),
        "grad_bytes_per_value": GRAD_DTYPES[run.grad_dtype]}
    out = {"inputs": inputs, "target_cu": target, "algorithms": {}}
    for alg in algorithms:
        sim = _simulate(alg, run, run.bandwidth if run.bandwidth is not None else math.inf)
        row = {k: v for k, v in sim.to_dict().items()
               if k not in ("algorithm", "bandwidth", "latency")}
        if run.bandwidth is None:
            row |= {"cu": None, "compute_s": None, "stall_s": None, "stall_per_step": None,
                    "peak_transfer_s": None}
        out["algorithms"][alg] = row | {"required_bandwidth": _required(alg, run, target)}
    return out


def config_of(cfg) -> "Config":
    """A validated lowband Config: cfg itself, or one from a mapping of its options (a run's
    config.json: its meta's measured link, if any, is the run's, not read again). Paths that
    are not here (data, a tokenizer) are left unchecked: the plan reads none of them."""
    from lowband.comm.link import recorded
    from lowband.config import Config
    from lowband.flags import validate_elsewhere

    try:
        if not isinstance(cfg, Config):
            values = dict(cfg)
            meta = values.pop("meta", None)
            cfg = recorded(Config.from_dict(values), meta)
        return validate_elsewhere(cfg)
    except ConfigError as e:
        raise PlanError(str(e)) from None


def variants(cfg: "Config", algorithms) -> dict:
    """cfg as each of `algorithms` would run it: cfg itself for its own algorithm; another at
    its own defaults (--fragments, --overlap, --codec, ... as `lowband train --algo X` sets
    them, the options of other algorithms it would refuse left out) with cfg's model, R, S, H,
    data, link and steps. name -> Config, or the sentence of the ConfigError refusing it."""
    out: dict = {}
    for name in dict.fromkeys(algorithms):
        if name == cfg.algo:
            out[name] = cfg
            continue
        other = copy.copy(cfg)
        other.algo = name
        if name not in REGISTRY:
            out[name] = f"unknown algorithm '{name}': use one of {', '.join(REGISTRY)}."
            continue
        for group in other._foreign_groups():  # what `lowband train --algo NAME` would refuse
            for f in fields(group) if not group.shared_knob else ():
                if f.name in group.names():
                    setattr(other, f.name, f.default)
        for key in REGISTRY[name].defaults:
            setattr(other, key, None)
        if cfg.local_steps != "fixed":  # resolved to tokens for cfg's steps: resolved again
            other.merge_weights = None  # for the other's (edit weighs by its penalty)
        other.guard = other.rollback = None  # each its own guard (edit: its penalty; no plan
        # figure reads them)
        try:
            out[name] = config_of(other)
        except PlanError as e:
            out[name] = str(e)
    return out


def plan_configs(cfg, algorithms=None, target_cu: float = 0.9, *, step_time=None, params=None,
                 steady: bool = False, calibration=None, **overrides) -> dict:
    """What `lowband plan --json` prints for a config: per algorithm (cfg's own first, then
    `algorithms`: default every one the planner models) the Run it makes (`inputs`, see
    variants), its plan on the config's link and its time to train the run's tokens and to reach
    the loss ddp's run ends at (target.py), or an `error`; `recommended`: the H and codec for the
    link (target.recommend). Without an emulated link (--link-bandwidth empty) only the
    bandwidth each needs. calibration: a finished `lowband compare` directory whose measured
    tokens factors replace the published figures for the settings it compared (calibrate.py;
    `calibration` in the result says which rows took one)."""
    cal = None if calibration is None else calibrate.read(calibration)
    cfg, target = config_of(cfg), _target(target_cu)
    names = list(dict.fromkeys([cfg.algo, *(modeled() if algorithms is None else algorithms)]))
    out = {"algorithm": cfg.algo, "target_cu": target, "algorithms": {}}
    if cal is not None:
        out["calibration"] = {"dir": cal.dir, "reference": cal.reference, "calibrated": {},
                              "not_reached": {}}
    rows = {}
    for name, c in variants(cfg, [*names, "ddp"]).items():  # ddp: the time to its loss
        try:
            if isinstance(c, str):
                raise PlanError(c)
            run = run_of(c, step_time, params=params, steady=steady, **overrides)
            row = plan(target, algorithms=(name,), run=run)
        except PlanError as e:
            rows[name] = {"error": str(e)}
            continue
        rows[name] = {"inputs": row["inputs"], **row["algorithms"][name]}
        rows[name] |= timing(c, run, rows[name])
        if cal is not None:
            _calibrated(cal, name, c, run, rows[name], out["calibration"])
    for name in names:
        if "error" not in rows[name] and "error" not in rows["ddp"]:
            rows[name] |= to_ddp_loss(rows[name], rows["ddp"])
        out["algorithms"][name] = rows[name]
    if "error" not in rows[cfg.algo]:
        out["recommended"] = recommend(
            cfg, lambda c: run_of(c, step_time, params=params, steady=steady, **overrides),
            lambda run: _simulate(cfg.algo, run, run.bandwidth).cu, target)
    return out


def _calibrated(cal, name: str, cfg, run: Run, row: dict, notes: dict) -> None:
    """The row's loss penalty measured by the comparison `cal`, where it compared the row's
    setting; `notes` records which rows took a factor and which matched a compared run that
    did not reach the target."""
    if name == "ddp":  # the baseline: ddp's tokens reach its own final loss
        return
    fit, source = cal.penalty(name, cfg, run.params)
    if fit is not None:
        row["loss_penalty"] = asdict(fit)
        notes["calibrated"][name] = {"run": source, "tokens_factor": fit.tokens_factor}
    elif source is not None:
        notes["not_reached"][name] = source


def plan_config(cfg, target_cu: float = 0.9, *, step_time=None, params=None, steady=False,
                **overrides) -> dict:
    """The plan of one run described by a lowband Config (or a mapping of its options), to set
    a measured run beside its prediction: a run without an emulated link ran on an unlimited
    one. overrides: make_run's arguments (step_time, params, bandwidth, ...)."""
    cfg = config_of(cfg)
    if not cfg.link_bandwidth:
        overrides.setdefault("bandwidth", "inf")
    run = run_of(cfg, step_time, params=params, steady=steady, **overrides)
    result = plan(target_cu, algorithms=(cfg.algo,), run=run)
    return {"inputs": result["inputs"], "target_cu": result["target_cu"], "algorithm": cfg.algo,
            **result["algorithms"][cfg.algo]}


def figure(target_cu: float = 0.9, algorithms=ALGORITHMS, points: int = 60, bandwidths=None,
           **params):
    """A plotly Figure of CU against bandwidth (log x axis), one curve per algorithm, the target
    as a dashed line and the given --bandwidth, if any, as a dotted one. By default the x axis
    spans 100x around the bandwidths the algorithms need."""
    run = _run(params)
    fig = curves([(alg, alg, run) for alg in algorithms], target_cu, points, bandwidths)
    if run.bandwidth is not None:
        fig.add_vline(x=run.bandwidth, line_dash="dot",
                      annotation_text=fmt_bandwidth(run.bandwidth))
    title = f"Compute utilization, {fmt_count(run.params)} params, {run.replicas} replicas"
    fig.update_layout(title=title)
    return fig


def curves(lines, target_cu: float = 0.9, points: int = 60, bandwidths=None, links=()):
    """A plotly Figure of CU against bandwidth (log x axis): one curve per (label, algorithm,
    Run) of `lines`, the target as a dashed line; by default the x axis spans 100x around the
    bandwidths they need, or with `links` (the bandwidths of runs to draw on it) 10x around
    those and the needs, within 1/100 to 1000x the links."""
    needs_extra("ui", "the planner's figure", "plotly")
    import plotly.graph_objects as go

    target = _target(target_cu)
    if bandwidths is None:
        need = [b for _, a, run in lines if (b := _required(a, run, target))] or [1e9]
        lo, hi = min(need) / 100, max(need) * 100
        links = [b for b in links if 0 < b < math.inf]
        if links:
            lo = max(min(need + list(links)) / 10, min(links) / 100)
            hi = min(max(need + list(links)) * 10, max(links) * 1000)
        bandwidths = [lo * (hi / lo) ** (i / (points - 1)) for i in range(points)]
    fig = go.Figure()
    for label, alg, run in lines:
        fig.add_trace(go.Scatter(x=list(bandwidths), name=label, mode="lines",
                                 y=[_simulate(alg, run, b).cu for b in bandwidths]))
    fig.add_hline(y=target, line_dash="dash", annotation_text=f"target CU {target:g}")
    fig.update_layout(xaxis=bandwidth_axis(min(bandwidths), max(bandwidths)),
                      yaxis=dict(title="compute utilization", range=[0, 1.05]))
    return fig


def bandwidth_axis(lo: float, hi: float) -> dict:
    """A log x axis from lo to hi bit/s with a tick at each power of ten labelled in bit/s
    units (10 Mbit/s, 1 Gbit/s), where plotly's own labels (10M, 1B) read as counts or bytes."""
    ticks = [10.0 ** k for k in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)]
    return dict(type="log", title="bandwidth", range=[math.log10(lo), math.log10(hi)],
                tickvals=ticks, ticktext=[fmt_bandwidth(t) for t in ticks])
