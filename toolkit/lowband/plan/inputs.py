"""The inputs of a plan: presets, codecs, unit parsing and one validation with clear messages."""

from __future__ import annotations

import math
import re

from lowband import units
from lowband.algorithms import ALGORITHMS as REGISTRY, Algorithm
from lowband.algorithms.pace import declared
from lowband.comm import wire
from lowband.comm.codecs import CODEC_RECORDS
from lowband.faults import parse_straggler
from lowband.comm.sends import (GRAD_BYTES, Run, block, exchange_phases,  # noqa: F401
                                payload_bytes)
from lowband.models import spec
from lowband.models.gpt import MODELS as MODEL_SPECS
from lowband.options import ConfigError, UserError
from lowband.plan.fragments import (even_fragments, even_units, model_fragments, model_size,
                                    model_units)

def modeled() -> list[str]:
    """The registered algorithms the planner models: those whose class declares (or inherits)
    outer_link (algorithms/base.py), lowband's own and those registered from outside."""
    return [name for name, cls in REGISTRY.items()
            if getattr(cls.outer_link, "__func__", None) is not Algorithm.outer_link.__func__]


ALGORITHMS = tuple(REGISTRY.builtin)  # lowband's own: every one is modeled
CODECS = tuple(CODEC_RECORDS)  # what diloco and streaming may send (lowband.comm.codecs)
GRAD_DTYPES = GRAD_BYTES
# preset -> (parameters, blocks), from the model registry at each preset's own context length
MODELS = {name: (m.param_count(), m.n_layer) for name, m in MODEL_SPECS.items()}


class PlanError(UserError, ValueError):
    """Input a user can fix; its message is one sentence naming the fix."""


_SI = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9, "t": 1e12}
_NUM = r"\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*"


def parse_bandwidth(value) -> float:
    """Bits per second (lowband.units.parse_bandwidth), positive."""
    try:
        bw = units.parse_bandwidth(value)
    except ValueError as e:
        raise PlanError(f"{e}.") from None
    if not bw > 0:
        raise PlanError(f"bandwidth must be positive, got {value}: give bits per second "
                        "like 1gbit.")
    return bw


def _number(value, name: str, seconds: bool = False) -> float:
    """A float from 1e9, '1.3B', '124M' (counts) or '50ms', '100us' (seconds)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if seconds:
        try:
            return units.parse_duration(value)
        except ValueError:
            raise PlanError(f"cannot read --{name} '{value}': give a number like 0.1 or 100ms.") from None
    m = re.fullmatch(_NUM + r"([kKmMbBgGtT]?)\s*", str(value).strip())
    if not m:
        raise PlanError(f"cannot read --{name} '{value}': give a number like 1e9 or 1.3B.")
    return float(m.group(1)) * _SI[m.group(2).lower()]


def _integer(value, name: str, low: int) -> int:
    number = _number(value, name)
    if number != int(number) or number < low:
        kind = "a positive integer" if low == 1 else "an integer >= 0"
        raise PlanError(f"--{name} must be {kind}, got {value}.")
    return int(number)


SHAPE = ("n_layer", "n_head", "d_model", "vocab_size", "seq_len")  # lowband's size overrides


def trained(cfg) -> dict:
    """make_run's arguments that are `lowband train` options, from a Config (by its own names):
    what run_of plans, and what make_run takes for those not given (a default Config's)."""
    return dict(replicas=cfg.replicas, shards=cfg.shards, sync_every=cfg.sync_every,
                fragments=cfg.fragments or 1, overlap=cfg.overlap or 0, codec=cfg.codec or "fp32",
                fragment_pattern=cfg.fragment_pattern, exchange=cfg.exchange, density=cfg.density,
                sparse_chunk=cfg.sparse_chunk, block_size=cfg.codec_block,
                bucket_mb=cfg.bucket_mb, sync_seconds=cfg.sync_seconds,
                acco_adaptive=cfg.acco_micro == "adaptive", straggler=cfg.straggler,
                local_steps=cfg.local_steps)


def make_run(params=None, layers=None, step_time=None, **given) -> Run:
    """Validate and normalize the inputs; raises PlanError (a ValueError) naming the fix.

    given: the planner's own inputs (model, flops_per_step and flops, grad_dtype, bandwidth,
    latency, steps, acco_rounds, fragment_sizes, the model's sizes) and `lowband train` options
    under trained()'s names (replicas, sync_every, fragments, codec, block_size, bucket_mb, ...).
    An option not given is a default Config's, so the planner has no defaults of its own (a None
    fragments, overlap or codec, which a Config resolves per algorithm: 1, 0, fp32). Without
    them: no link (bandwidth None: the plan says what it needs), the steady state (steps None),
    fp32 gradients, acco's two rounds.
    """
    from lowband.config import Config

    return _run(params, layers, step_time, **(trained(Config()) | given))


def _run(params, layers, step_time, *, model=None, flops_per_step=None, flops=None,
         grad_dtype="fp32", bandwidth=None, latency=0.0, steps=None, acco_rounds=2,
         fragment_sizes=None, n_head=0, d_model=0, vocab_size=0, seq_len=0, replicas, shards,
         sync_every, fragments, overlap, codec, fragment_pattern, exchange, density, sparse_chunk,
         block_size, bucket_mb, sync_seconds, acco_adaptive, straggler, local_steps) -> Run:
    """make_run's Run, every `lowband train` option given.

    model: a preset or hf:PATH, built on the meta device for its parameter count, blocks and
    real fragment sizes; `layers` (a preset's n_layer) and n_head, d_model, vocab_size, seq_len
    (0: the preset's) size it as lowband train does. With `params` given too and different from
    the model's count (a user's own module), the parameters are spread evenly over the blocks,
    as they are without a model."""
    shape = None
    if model is not None:
        layers, shape = _model_layers(model, layers, (n_head, d_model, vocab_size, seq_len))
        counted = model_size(model, *shape)[0]
        params = counted if params is None else params
    if params is None or layers is None:
        raise PlanError("give the model size with --params and --layers, or a preset with "
                        "--model.")
    params = _number(params, "params")
    if not params > 0:
        raise PlanError(f"--params must be positive (e.g. --params 1e9), got {params:g}.")
    if step_time is None:
        if flops_per_step is None or flops is None:
            raise PlanError("give the step time with --step-time SECONDS (or probe: measured "
                            "here), --config RUN_DIR of a finished run, or --flops-per-step "
                            "together with --flops (achieved FLOP/s).")
        fps, rate = _number(flops_per_step, "flops-per-step"), _number(flops, "flops")
        if not (fps > 0 and rate > 0):
            raise PlanError("--flops-per-step and --flops must both be positive.")
        step_time = fps / rate
    step_time = _number(step_time, "step-time", seconds=True)
    if not 0 < step_time < math.inf:
        raise PlanError(f"--step-time must be a positive number of seconds, got {step_time:g}.")
    layers, replicas = _integer(layers, "layers", 1), _integer(replicas, "replicas", 1)
    shards = _integer(shards, "shards", 1)
    sync_seconds = _number(sync_seconds, "sync-seconds", seconds=True)
    if not 0 <= sync_seconds < math.inf:
        raise PlanError(f"--sync-seconds must be zero or a positive number, got {sync_seconds:g}.")
    sync_every = _integer(sync_every, "sync-every", 1)
    fragments, overlap = _integer(fragments, "fragments", 1), _integer(overlap, "overlap", 0)
    block_size = _integer(block_size, "block-size", 1)
    acco_rounds = _integer(acco_rounds, "acco-rounds", 1)
    if fragments > layers:
        raise PlanError(f"--fragments {fragments} exceeds --layers {layers}: a fragment needs at "
                        "least one block, so use at most as many fragments as blocks.")
    if fragments > sync_every:
        raise PlanError(f"--fragments {fragments} exceeds --sync-every {sync_every}: use at most "
                        "one fragment per inner step of the sync period.")
    if overlap >= sync_every:
        raise PlanError(f"--overlap {overlap} must be smaller than --sync-every {sync_every} "
                        "(a fragment must be merged before its next sync).")
    if fragment_pattern not in ("strided", "sequential"):
        raise PlanError(f"unknown fragment pattern '{fragment_pattern}': use strided or "
                        "sequential.")
    codec = str(codec).lower().replace("_", "-")
    codec = {"fp4": "fp4-e3m0", "e3m0": "fp4-e3m0", "e2m1": "fp4-e2m1"}.get(codec, codec)
    if codec not in CODECS:
        raise PlanError(f"unknown codec '{codec}': use one of {', '.join(CODECS)}.")
    density, sparse_chunk = _number(density, "density"), _integer(sparse_chunk, "sparse-chunk", 1)
    if not 0 < density <= 1:
        raise PlanError(f"--density must lie in (0, 1], got {density:g}.")
    try:  # refuses an unknown exchange, or two phases for a codec that cannot take them
        wire.exchange_plan(codec, 0, 2, 1, exchange)
    except ValueError as e:
        raise PlanError(f"--exchange: {e}.") from None
    grad_dtype = str(grad_dtype).lower()
    if grad_dtype not in GRAD_DTYPES:
        raise PlanError(f"unknown grad dtype '{grad_dtype}': use one of "
                        f"{', '.join(GRAD_DTYPES)}.")
    bandwidth = None if bandwidth is None else parse_bandwidth(bandwidth)
    latency = _number(latency, "latency", seconds=True)
    if not 0 <= latency < math.inf:
        raise PlanError(f"--latency must be zero or a positive number of seconds, "
                        f"got {latency:g}.")
    steps = None if steps is None else _integer(steps, "steps", 1)
    bucket_mb = None if bucket_mb is None else _number(bucket_mb, "bucket-mb")
    if bucket_mb is not None and not bucket_mb > 0:
        raise PlanError(f"--bucket-mb must be positive, got {bucket_mb:g}.")
    real = shape is not None and params == counted  # the model that ran, split as lowband does
    if fragment_sizes is None:
        fragment_sizes = (model_fragments(model, fragments, fragment_pattern, *shape) if real
                          else even_fragments(round(params), layers, fragments, fragment_pattern))
    fragment_sizes = tuple(int(n) for n in fragment_sizes)
    if len(fragment_sizes) != fragments or sum(fragment_sizes) != round(params):
        raise PlanError(f"fragment_sizes {list(fragment_sizes)} must be {fragments} counts "
                        f"adding up to the {round(params)} parameters.")
    unit_sizes = model_units(model, *shape) if real else even_units(round(params), layers)
    slowdowns, local_steps = _paces(straggler, local_steps, replicas)
    return Run(params, layers, step_time, replicas, sync_every, fragments, overlap, codec,
               grad_dtype, bandwidth, latency, steps, block_size, density, sparse_chunk, exchange,
               bucket_mb, acco_rounds, fragment_pattern, fragment_sizes, shards, unit_sizes,
               sync_seconds, bool(acco_adaptive), slowdowns, local_steps)


def _paces(straggler, local_steps, replicas: int) -> tuple[tuple[float, ...], str]:
    """(each replica's compute factor, --local-steps) as lowband train reads them: straggler is
    --straggler's text (REPLICA:FACTOR,...) or a mapping replica -> factor; PlanError with the
    flag's own sentence for a factor below 1, an unknown replica or a speed a replica short."""
    if isinstance(straggler, dict):
        straggler = ",".join(f"{r}:{f}" for r, f in straggler.items())
    try:
        factors = parse_straggler(straggler or "", replicas)
        local_steps = str(local_steps or "fixed")
        declared(local_steps, replicas)
    except ConfigError as e:
        raise PlanError(str(e)) from None
    return tuple(float(factors.get(r, 1.0)) for r in range(replicas)), local_steps


def run_of(cfg, step_time=None, *, params=None, steady: bool = False, **overrides) -> Run:
    """The Run of a validated lowband Config (read by its own option names): its model (or a
    model of `params` parameters spread evenly over its blocks), R, S, H, P, tau, codec and
    exchange, buckets, emulated link (none: the CU is not simulated, only the bandwidth needed),
    and its --steps as a whole run (steady: the periodic regime instead), with the compute time
    of a step (`step_time`, or flops_per_step and flops among the overrides). What lowband
    sends: fp32 gradients (ddp, zero1, acco). overrides: make_run's arguments, over these."""
    kw = dict(
        params=params, layers=cfg.n_layer or None, step_time=step_time, model=cfg.model,
        n_head=cfg.n_head, d_model=cfg.d_model, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len,
        **trained(cfg), bandwidth=cfg.link_bandwidth or None, latency=cfg.link_latency,
        steps=None if steady else cfg.steps)
    if params is not None and not cfg.n_layer:  # spread over the model's own blocks
        kw["layers"] = cfg.n_blocks()
    return make_run(**(kw | overrides))


def _model_layers(model: str, layers, sizes: tuple) -> tuple[int, tuple[int, ...]]:
    """(blocks, the size overrides model_size takes) of a named model; PlanError naming the fix
    for an unknown or unusable one, or a --layers its files fix (a Hugging Face config)."""
    try:
        record = spec(model)
    except ConfigError as e:
        raise PlanError(str(e)) from None
    n_layer = 0 if layers is None else _integer(layers, "layers", 1)
    flags = ("n-head", "d-model", "vocab-size", "seq-len")
    shape = (n_layer, *(_integer(v, flag, 0) for v, flag in zip(sizes, flags)))
    if record.sizes_from:
        if n_layer not in (0, record.n_layer) or any(shape[1:-1]):
            raise PlanError(f"--layers and the model's sizes do not apply to --model {model}: "
                            f"{record.sizes_from} sets them.")
        shape = (0,) * len(SHAPE)
    return model_size(model, *shape)[1], shape


# ----------------------------------------------------------------------------- printing

def fmt_bandwidth(bits: float | None) -> str:
    if bits is None:
        return "unreachable"
    if bits == 0 or math.isinf(bits):
        return "any" if bits == 0 else "inf"
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.3g} {unit}"
    return f"{bits:.3g} bit/s"


def fmt_bytes(n: float) -> str:
    return units.fmt_si(n, "B")


def fmt_count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def fmt_seconds(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"
