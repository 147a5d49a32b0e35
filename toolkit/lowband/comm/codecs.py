"""Codecs for what crosses the outer link: fp32, bf16, int8 and two 4-bit floats.

`encode(x)` turns a flat fp32 tensor into ONE uint8 tensor, the exact bytes that travel;
`decode(payload, n)` turns it back into n fp32 values. Decoding (and any sum over replicas)
happens in fp32.

Quantized codecs cut the values into blocks of `block` values (the last may be short); each
block has a bf16 scale (2 bytes); the scales come first in the payload, then the codes:
  int8       q = round(x / s), s = absmax / 127, |q| <= 127            1 byte a value
  fp4-e2m1   sign + the OCP MX FP4 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}, s = absmax / 6
  fp4-e3m0   sign + a 3-bit exponent, no mantissa: magnitudes {0, 2^-6, 2^-5, ..., 2^0},
             s = absmax (code 0 is zero, code k is 2^(k-7))
4-bit codes round |x| / s to the nearest magnitude, a tie to the smaller one, and pack two to a
byte (value 2i in the low nibble, 2i+1 in the high one), so the bytes on the wire are real.
Bytes for n values:
  fp32 4n, bf16 2n, int8 n + 2 ceil(n/block), fp4 ceil(n/2) + 2 ceil(n/block).
Worst-case error per value, s the block's scale: int8 s/2; fp4-e2m1 s (between 4 and 6);
fp4-e3m0 |x|/3 for |x| >= 2^-6 s, else |x| (flushed to zero or rounded up to 2^-6 s);
plus the bf16 rounding of s (2^-8 relative). s is capped so that the largest code times s stays
finite: in a block whose absmax is above 3.38e38 (near the fp32 maximum) add up to 2^-7 |x|.
Inputs holding NaN or inf are refused with NonFiniteError: a broken pseudo-gradient must not be
quietly turned into numbers.

`compiled=True` runs the quantized codecs through torch.compile: the same functions, one graph
per codec, block and device for every size, bitwise the eager bytes and values (checked on CPU
by tests/test_codecs_compiled.py, on a GPU by benchmarks/gpu_codecs.py). On CUDA, compiled
means two hand-written Triton kernels (codecs_triton.py), one pass each way, and it is the
default there (compiled=None); elsewhere the default is eager.
"""

from __future__ import annotations

import functools
import itertools
import math
import types

import torch
import torch.nn.functional as F

from dataclasses import dataclass


@dataclass(frozen=True)
class Codec:
    """One codec's facts, read by the collectives, the config, the CLI's help and the planner."""
    name: str
    value_bytes: float  # bytes a value on the wire, before scales
    scaled: bool        # one bf16 scale (2 bytes) per block of values
    help: str

    def bytes_per_value(self, block: int = 64) -> float:
        return self.value_bytes + (SCALE_BYTES / block if self.scaled else 0.0)

    def payload_bytes(self, n: int, block: int = 64) -> int:
        return payload_bytes(self.name, n, block)

    def encode(self, x: torch.Tensor, block: int = 64, compiled: bool | None = None) -> torch.Tensor:
        return encode(x, self.name, block, compiled)

    def decode(self, payload: torch.Tensor, n: int, block: int = 64,
               compiled: bool | None = None) -> torch.Tensor:
        return decode(payload, n, self.name, block, compiled)


SCALE_BYTES = 2  # one bf16 scale per block
CODEC_RECORDS = {c.name: c for c in (
    Codec("fp32", 4.0, False, "full precision (a ring all-reduce)"),
    Codec("bf16", 2.0, False, "bfloat16"),
    Codec("int8", 1.0, True, "8-bit integers, a bf16 scale per block"),
    Codec("fp4-e3m0", 0.5, True, "4-bit floats, 3-bit exponent (the Streaming DiLoCo paper's)"),
    Codec("fp4-e2m1", 0.5, True, "4-bit floats, OCP MX FP4"),
)}
CODECS = tuple(CODEC_RECORDS)  # the names

_LEVELS = {
    "fp4-e2m1": (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0),
    "fp4-e3m0": (0.0,) + tuple(2.0 ** (k - 7) for k in range(1, 8)),
}
_TOP = {"int8": 127.0, "fp4-e2m1": 6.0, "fp4-e3m0": 1.0}  # the largest code magnitude


def _bf16_below(v: float) -> float:
    unit = 2.0 ** (math.frexp(v)[1] - 8)  # bf16 keeps 8 significant bits
    return math.floor(v / unit) * unit


_CAP = {c: _bf16_below(torch.finfo(torch.float32).max / top) for c, top in _TOP.items()}
# Inductor drops a bf16 round trip and Triton divides approximately unless told to match eager.
_EAGER_NUMERICS = ("emulate_precision_casts", "eager_numerics.division_rounding",
                   "emulate_divison_rounding", "eager_numerics.disable_ftz")  # names vary by torch


class NonFiniteError(ValueError):
    pass


def payload_bytes(codec: str, n: int, block: int = 64) -> int:
    """The exact size of encode()'s output for n values."""
    scales = SCALE_BYTES * math.ceil(n / block)
    return {"fp32": 4 * n, "bf16": 2 * n, "int8": n + scales}.get(codec, (n + 1) // 2 + scales)


def _encode_blocks(x: torch.Tensor, codec: str, block: int):
    """A quantized codec's encode: (payload, whether all of x is finite)."""
    n = x.numel()
    padded = F.pad(x, (0, (-n) % block)).view(-1, block)
    absmax = padded.abs().amax(dim=1)  # NaN or inf where the block holds one
    # a divisor tensor, not a Python number: CUDA multiplies by the reciprocal of a scalar
    # divisor (one bit off at times), which would make the GPU's scales differ from the CPU's
    top = torch.full((), _TOP[codec], device=x.device)
    scale = torch.clamp(absmax / top, max=_CAP[codec]).bfloat16()
    s = scale.float()
    s = torch.where(s > 0, s, 1.0)[:, None]
    if codec == "int8":
        codes = torch.clamp(torch.round(padded / s), -127, 127).to(torch.int8).view(torch.uint8)
        size = n
    else:  # the count of midpoints below |x| / s: ties go down, as torch.bucketize did
        levels, a = _LEVELS[codec], padded.abs() / s
        mag = sum((a > (lo + hi) / 2).to(torch.uint8) for lo, hi in itertools.pairwise(levels))
        nib = mag | (padded < 0).to(torch.uint8) << 3
        if block % 2:  # pairs cross blocks
            nib = F.pad(nib.view(-1), (0, nib.numel() % 2))
        nib = nib.reshape(-1, 2)  # value 2i in the low nibble
        codes = nib[:, 0] | nib[:, 1] << 4
        size = (n + 1) // 2
    # whole blocks into the cat and the cut after it: a cut before the cat copies the codes
    payload = torch.cat([scale.view(torch.uint8), codes.reshape(-1)])
    return payload[: 2 * scale.numel() + size], torch.isfinite(absmax).all()


def _decode_blocks(payload: torch.Tensor, scale: torch.Tensor, codec: str, block: int):
    """A quantized codec's decode (`scale`: the payload's scale bytes as bf16): the values of
    whole blocks, of which the caller keeps the first n. Each value's code byte is gathered by
    index (clamped: past the last code the values are junk the caller cuts), so the compiled
    graph holds no slice or pad whose bounds depend on the size (Inductor on CUDA could not
    lower those) and no loop whose length is not a multiple of the block (Inductor on CPU tiled
    such a loop into whole blocks and dropped the rest)."""
    nb = scale.numel()
    i = torch.arange(nb * block, device=payload.device)
    per_byte = 1 if codec == "int8" else 2  # fp4: value 2k in the low nibble of byte k
    byte = payload[torch.clamp(2 * nb + i // per_byte, max=payload.numel() - 1)]
    if codec == "int8":  # two's complement by arithmetic, not a view as int8
        u = byte.float()
        q = torch.where(u >= 128, u - 256, u)
    else:
        nib = (byte >> ((i % 2) * 4).to(torch.uint8)) & 15
        levels = _LEVELS[codec]
        q = torch.tensor(levels + tuple(-v for v in levels), device=payload.device)[nib.int()]
    return (q.view(nb, block) * scale.float()[:, None]).view(-1)


@functools.cache
def _compiled(fn, codec: str, block: int):
    """fn compiled with codec and block as constants, sizes left open (unbacked: one graph for
    every size, 0 and 1 too). Its own code object: dynamo keeps graphs (8 at most) per code."""
    import torch._inductor.config as inductor

    name = f"{fn.__name__}_{codec.replace('-', '_')}_{block}"
    code = fn.__code__.replace(co_name=name)
    own = types.FunctionType(code, fn.__globals__, name, (codec, block))
    known = inductor.get_config_copy()
    options = {k: True for k in _EAGER_NUMERICS if k in known}
    return torch.compile(own, fullgraph=True, options=options)


def _run(fn, codec: str, block: int, compiled: bool, *tensors: torch.Tensor):
    if not compiled:
        return fn(*tensors, codec, block)
    # fresh aliases, not views (dynamo guards on a view's base): the marks stay off the caller's
    tensors = tuple(t.detach() for t in tensors)
    for t in tensors:
        torch._dynamo.decorators.mark_unbacked(t, 0)
    return _compiled(fn, codec, block)(*tensors)


def _triton(t: torch.Tensor, block: int, compiled: bool | None):
    """The Triton codecs (codecs_triton.py) when they serve: compiled (None: on CUDA) on a
    CUDA tensor with a power-of-two block; else None."""
    if not t.is_cuda or compiled is False:
        return None
    try:
        from lowband.comm import codecs_triton
    except ImportError:  # no Triton: torch.compile's path
        return None
    return codecs_triton if codecs_triton.usable(block) else None


def _mids(codec: str) -> tuple:
    return tuple((lo + hi) / 2 for lo, hi in itertools.pairwise(_LEVELS[codec])) if codec in _LEVELS else ()


def encode(x: torch.Tensor, codec: str, block: int = 64, compiled: bool | None = None) -> torch.Tensor:
    """x's bytes in the codec. compiled: torch.compile (Triton kernels on CUDA) rather than
    eager; None: compiled on CUDA, eager elsewhere. The bytes are the same either way."""
    x = x.detach().reshape(-1).float()
    if codec in ("fp32", "bf16"):  # one copy each, compiled or not
        finite = torch.isfinite(x).all()
        payload = (x.clone() if codec == "fp32" else x.bfloat16()).view(torch.uint8)
    elif (fast := _triton(x, block, compiled)) is not None:
        payload, finite = fast.encode(x.contiguous(), payload_bytes(codec, x.numel(), block),
                                      block, _TOP[codec], _CAP[codec], _mids(codec))
    else:
        payload, finite = _run(_encode_blocks, codec, block, bool(compiled), x)
    if not finite:
        raise NonFiniteError("the tensor to encode holds NaN or inf")
    return payload


def decode(payload: torch.Tensor, n: int, codec: str, block: int = 64,
           compiled: bool | None = None) -> torch.Tensor:
    """n fp32 values from encode()'s bytes; compiled as for encode()."""
    if payload.numel() != payload_bytes(codec, n, block):
        raise ValueError(f"a {codec} payload of {n} values has {payload_bytes(codec, n, block)} "
                         f"bytes, got {payload.numel()}")
    if codec == "fp32":
        return payload.view(torch.float32).clone()
    if codec == "bf16":
        return payload.view(torch.bfloat16).float()
    fast = _triton(payload, block, compiled)
    if fast is not None:
        table = None
        if codec in _LEVELS:
            levels = _LEVELS[codec]
            table = torch.tensor(levels + tuple(-v for v in levels), device=payload.device)
        return fast.decode(payload.contiguous(), n, block, table)
    scale = payload[: 2 * math.ceil(n / block)].view(torch.bfloat16)
    return _run(_decode_blocks, codec, block, bool(compiled), payload, scale)[:n]
