"""The inputs of a plan: presets, codecs, unit parsing and one validation with clear messages."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from lowband import units
from lowband.algorithms import ALGORITHMS as REGISTRY
from lowband.comm.codecs import CODEC_RECORDS, SCALE_BYTES
from lowband.model import MODELS as MODEL_SPECS
from lowband.options import ConfigError
from lowband.sources import HF, spec

# the algorithms whose schedule the planner models (timeline.py), in the registry's order
ALGORITHMS = tuple(name for name in REGISTRY if name in ("ddp", "diloco", "streaming", "acco"))
# bytes per value on the wire; the quantized codecs add one scale per block of values
CODECS = {name: c.value_bytes for name, c in CODEC_RECORDS.items()}
SCALED = tuple(name for name, c in CODEC_RECORDS.items() if c.scaled)
GRAD_DTYPES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0}
BLOCK_SIZE = 64  # values per scale block
# preset -> (parameters, blocks), from the model registry at each preset's own context length
MODELS = {name: (m.param_count(), m.n_layer) for name, m in MODEL_SPECS.items()}


class PlanError(ValueError):
    """Input a user can fix; its message is one sentence naming the fix."""


@dataclass(frozen=True)
class Run:
    """The validated inputs of one plan (everything but the algorithm)."""
    params: float
    layers: int
    step_time: float
    replicas: int = 2
    sync_every: int = 100
    fragments: int = 1
    overlap: int = 0
    codec: str = "fp32"
    grad_dtype: str = "bf16"
    bandwidth: float | None = None
    latency: float = 0.0
    steps: int | None = None
    block_size: int = BLOCK_SIZE
    scale_bytes: float = SCALE_BYTES
    bucket_mb: float | None = None
    acco_rounds: int = 2


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


def make_run(params=None, layers=None, step_time=None, *, model=None, flops_per_step=None,
             flops=None, replicas=2, sync_every=100, fragments=1, overlap=0, codec="fp32",
             grad_dtype="bf16", bandwidth=None, latency=0.0, steps=None, block_size=BLOCK_SIZE,
             scale_bytes=SCALE_BYTES, bucket_mb=None, acco_rounds=2) -> Run:
    """Validate and normalize the inputs; raises PlanError (a ValueError) naming the fix."""
    if model is not None and model.startswith(HF):  # a Hugging Face config: counted, not built
        try:
            hf = spec(model)
        except ConfigError as e:
            raise PlanError(str(e)) from None
        params = hf.param_count() if params is None else params
        layers = hf.n_layer if layers is None else layers
    elif model is not None:
        if model not in MODELS:
            raise PlanError(f"unknown model '{model}': use one of {', '.join(MODELS)}, or "
                            "hf:PATH (a Hugging Face model directory or config.json).")
        params = MODELS[model][0] if params is None else params
        layers = MODELS[model][1] if layers is None else layers
    if params is None or layers is None:
        raise PlanError("give the model size with --params and --layers, or a preset with "
                        "--model.")
    params = _number(params, "params")
    if not params > 0:
        raise PlanError(f"--params must be positive (e.g. --params 1e9), got {params:g}.")
    if step_time is None:
        if flops_per_step is None or flops is None:
            raise PlanError("give the step time with --step-time SECONDS, or --flops-per-step "
                            "together with --flops (achieved FLOP/s).")
        fps, rate = _number(flops_per_step, "flops-per-step"), _number(flops, "flops")
        if not (fps > 0 and rate > 0):
            raise PlanError("--flops-per-step and --flops must both be positive.")
        step_time = fps / rate
    step_time = _number(step_time, "step-time", seconds=True)
    if not 0 < step_time < math.inf:
        raise PlanError(f"--step-time must be a positive number of seconds, got {step_time:g}.")
    layers, replicas = _integer(layers, "layers", 1), _integer(replicas, "replicas", 1)
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
    codec = str(codec).lower().replace("_", "-")
    codec = {"fp4": "fp4-e3m0", "e3m0": "fp4-e3m0", "e2m1": "fp4-e2m1"}.get(codec, codec)
    if codec not in CODECS:
        raise PlanError(f"unknown codec '{codec}': use one of {', '.join(CODECS)}.")
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
    scale_bytes = _number(scale_bytes, "scale-bytes")
    if scale_bytes < 0:
        raise PlanError(f"--scale-bytes must be zero or positive, got {scale_bytes:g}.")
    bucket_mb = None if bucket_mb is None else _number(bucket_mb, "bucket-mb")
    if bucket_mb is not None and not bucket_mb > 0:
        raise PlanError(f"--bucket-mb must be positive, got {bucket_mb:g}.")
    return Run(params, layers, step_time, replicas, sync_every, fragments, overlap, codec,
               grad_dtype, bandwidth, latency, steps, block_size, scale_bytes, bucket_mb,
               acco_rounds)


def bytes_per_value(codec: str, block_size: int = BLOCK_SIZE,
                    scale_bytes: float = SCALE_BYTES) -> float:
    """Wire bytes per value: fp32 4, bf16 2, int8 1, fp4 0.5; + scale_bytes/block_size if scaled."""
    return CODECS[codec] + (scale_bytes / block_size if codec in SCALED else 0.0)


def ring_wire_bytes(payload: float, replicas: int) -> float:
    """Bytes each replica sends in a ring all-reduce of `payload` bytes among R replicas."""
    return 2 * (replicas - 1) / replicas * payload


def exchange_wire_bytes(payload: float, replicas: int, codec: str) -> float:
    """Bytes each replica sends to average `payload` bytes (encoded) over R replicas, as
    lowband.comm does: fp32 is a ring all-reduce; any other codec all-gathers the encoded
    payloads ((R-1) x payload: quantized values cannot be summed on the way)."""
    return ring_wire_bytes(payload, replicas) if codec == "fp32" else (replicas - 1) * payload


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
