"""Codecs for what crosses the outer link: fp32, bf16, int8, two 4-bit floats, and two sparse
codecs (top-k with 2-bit or 4-bit values).

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
The topk codecs (SparseLoCo's, arXiv 2508.15706) send of each chunk of `block` values the
max(1, round(density x length)) largest in magnitude, each with its index in the chunk in
ceil(log2 block) bits, zero elsewhere (layout and ties: comm/sparse.py); values are coded as
  topk-2bit  sign + one bit: the upper half of the chunk's kept values by magnitude decode to
             hi, the rest to lo, two bf16 scales a chunk: the halves' mean magnitudes (the
             least squared error for that split)
  topk-fp4   fp4-e2m1, one bf16 scale a chunk
`block` for a topk codec: the chunk (an int, with `density`) or a Chunks(size, density).
Bytes for n values in c chunks, K kept, b code bits (2 or 4), s scales a chunk (2 or 1):
  2 s c + ceil(K (b + ceil(log2 block)) / 8).
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

from lowband.comm import sparse
from lowband.comm.sparse import CHUNK, DENSITY, Chunks  # noqa: F401 (CHUNK: for importers)


@dataclass(frozen=True)
class Codec:
    """One codec's facts, read by the collectives, the config, the CLI's help and the planner.

    two_phase: Comm.average may take the two-phase exchange (comm/wire.py) in this codec: a
    chunk of whole blocks encodes and decodes on its own, and the fp32 sum of the decoded
    chunks can be encoded again. Every dense codec takes it unless `no_two_phase` says why
    not; a codec that does not keeps the all-gather (or for fp32 the all-reduce)."""
    name: str
    value_bytes: float  # bytes a value on the wire, before scales
    scaled: bool        # bf16 scales (2 bytes each) per block of values
    help: str
    sparse: bool = False  # topk: only a `density` share of each block travels, with its indices
    scales: int = 1     # bf16 scales per block, when scaled
    two_phase: bool = True
    no_two_phase: str = ""  # why not, when two_phase is False

    def __post_init__(self):
        if self.two_phase == bool(self.no_two_phase):
            raise ValueError(f"codec {self.name}: two_phase={self.two_phase} with "
                             f"no_two_phase={self.no_two_phase!r} (say why, exactly when not)")

    def bytes_per_value(self, block: "int | Chunks" = 64, density: float = DENSITY) -> float:
        """Wire bytes per value of whole blocks (for a topk codec: per value of the input)."""
        if self.sparse:  # 8 chunks: their words end on a byte
            chunk, density, _, _ = _topk(self.name, block, density)
            return payload_bytes(self.name, 8 * chunk, chunk, density) / (8 * chunk)
        return self.value_bytes + (SCALE_BYTES * self.scales / block if self.scaled else 0.0)

    def payload_bytes(self, n: int, block: "int | Chunks" = 64, density: float = DENSITY) -> int:
        return payload_bytes(self.name, n, block, density)

    def encode(self, x: torch.Tensor, block: "int | Chunks" = 64, density: float = DENSITY,
               compiled: bool | None = None) -> torch.Tensor:
        return encode(x, self.name, block, density, compiled)

    def decode(self, payload: torch.Tensor, n: int, block: "int | Chunks" = 64,
               density: float = DENSITY, compiled: bool | None = None) -> torch.Tensor:
        return decode(payload, n, self.name, block, density, compiled)


SCALE_BYTES = 2  # one bf16 scale per block
_SUM_NOT_SPARSE = ("the ranks keep different values of a chunk, so their sum is not top-k sparse "
                   "and re-encoding it would drop what the others sent")
CODEC_RECORDS = {c.name: c for c in (
    Codec("fp32", 4.0, False, "full precision (a ring all-reduce)", two_phase=False,
          no_two_phase="an all-reduce sums it exactly on the way, in fewer bytes"),
    Codec("bf16", 2.0, False, "bfloat16"),
    Codec("int8", 1.0, True, "8-bit integers, a bf16 scale per block"),
    Codec("fp4-e3m0", 0.5, True, "4-bit floats, 3-bit exponent (the Streaming DiLoCo paper's)"),
    Codec("fp4-e2m1", 0.5, True, "4-bit floats, OCP MX FP4"),
    # value_bytes of a topk codec: a kept value's code, before its index
    Codec("topk-2bit", 0.25, True, "top --density of each --sparse-chunk values by magnitude, "
          "2 bits each + an index (SparseLoCo's)", sparse=True, scales=2, two_phase=False,
          no_two_phase=_SUM_NOT_SPARSE),
    Codec("topk-fp4", 0.5, True, "top --density of each --sparse-chunk values by magnitude, "
          "fp4-e2m1 each + an index", sparse=True, two_phase=False, no_two_phase=_SUM_NOT_SPARSE),
)}
CODECS = tuple(CODEC_RECORDS)  # the names
SPARSE = tuple(name for name, c in CODEC_RECORDS.items() if c.sparse)
TWO_PHASE = tuple(name for name, c in CODEC_RECORDS.items() if c.two_phase)

_LEVELS = {
    "fp4-e2m1": (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0),
    "fp4-e3m0": (0.0,) + tuple(2.0 ** (k - 7) for k in range(1, 8)),
}
_LEVELS["topk-fp4"] = _LEVELS["fp4-e2m1"]
# the largest code magnitude (topk-2bit: its levels are the scales themselves)
_TOP = {"int8": 127.0, "fp4-e2m1": 6.0, "fp4-e3m0": 1.0, "topk-fp4": 6.0, "topk-2bit": 1.0}


def _bf16_below(v: float) -> float:
    unit = 2.0 ** (math.frexp(v)[1] - 8)  # bf16 keeps 8 significant bits
    return math.floor(v / unit) * unit


_CAP = {c: _bf16_below(torch.finfo(torch.float32).max / top) for c, top in _TOP.items()}
# Inductor drops a bf16 round trip and Triton divides approximately unless told to match eager.
_EAGER_NUMERICS = ("emulate_precision_casts", "eager_numerics.division_rounding",
                   "emulate_divison_rounding", "eager_numerics.disable_ftz")  # names vary by torch


class NonFiniteError(ValueError):
    pass


def payload_bytes(codec: str, n: int, block: "int | Chunks" = 64, density: float = DENSITY) -> int:
    """The exact size of encode()'s output for n values (density: topk codecs only), from the
    codec's record: value_bytes a value (the last byte of 4-bit codes half full) and its scales
    a block; a topk codec's layout is comm/sparse.py's."""
    c = CODEC_RECORDS[codec]
    if c.sparse:
        return sparse.size(n, *_topk(codec, block, density))
    scales = SCALE_BYTES * c.scales * math.ceil(n / block) if c.scaled else 0
    return math.ceil(n * c.value_bytes) + scales


def _topk(codec: str, block: "int | Chunks", density: float) -> tuple[int, float, int, int]:
    """A topk codec's chunk, density, code bits and bf16 scales a chunk."""
    chunk, density = (block.size, block.density) if isinstance(block, Chunks) else (block, density)
    c = CODEC_RECORDS[codec]
    return chunk, density, round(8 * c.value_bytes), c.scales


def _scale(absmax: torch.Tensor, codec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks' bf16 scales from their largest magnitudes, and the fp32 divisors of their values
    (one a row; 1 where the scale is 0)."""
    # a divisor tensor, not a Python number: CUDA multiplies by the reciprocal of a scalar
    # divisor (one bit off at times), which would make the GPU's scales differ from the CPU's
    top = torch.full((), _TOP[codec], device=absmax.device)
    scale = torch.clamp(absmax / top, max=_CAP[codec]).bfloat16()
    s = scale.float()
    return scale, torch.where(s > 0, s, 1.0)[:, None]


def _nibbles(v: torch.Tensor, s: torch.Tensor, codec: str) -> torch.Tensor:
    """4-bit codes of v / s: the count of midpoints between levels below |v| / s (ties go down,
    as torch.bucketize did), the sign in bit 3."""
    levels, a = _LEVELS[codec], v.abs() / s
    mag = sum((a > (lo + hi) / 2).to(torch.uint8) for lo, hi in itertools.pairwise(levels))
    return mag | (v < 0).to(torch.uint8) << 3


def _table(codec: str, device) -> torch.Tensor:
    """A 4-bit code's value at scale 1 (code 8 + m is minus level m)."""
    levels = _LEVELS[codec]
    return torch.tensor(levels + tuple(-v for v in levels), device=device)


def _encode_blocks(x: torch.Tensor, codec: str, block: int):
    """A quantized codec's encode: (payload, whether all of x is finite)."""
    n = x.numel()
    padded = F.pad(x, (0, (-n) % block)).view(-1, block)
    absmax = padded.abs().amax(dim=1)  # NaN or inf where the block holds one
    scale, s = _scale(absmax, codec)
    if codec == "int8":
        codes = torch.clamp(torch.round(padded / s), -127, 127).to(torch.int8).view(torch.uint8)
        size = n
    else:
        nib = _nibbles(padded, s, codec)
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
        q = _table(codec, payload.device)[nib.int()]
    return (q.view(nb, block) * scale.float()[:, None]).view(-1)


def _quantize_2bit(values: torch.Tensor, valid: torch.Tensor):
    """topk-2bit: bit 0 marks the upper half of a chunk's kept values by magnitude, bit 1 the
    sign; the chunk's scales (hi, lo) are the halves' mean magnitudes."""
    half = (valid.sum(1, keepdim=True) + 1) // 2
    upper = torch.arange(values.shape[1], device=values.device) < half
    lower = valid & ~upper
    mag = values.abs().double()  # a sum of fp32 maxima would overflow fp32
    hi = (mag * upper).sum(1) / upper.sum(1).clamp(min=1)
    lo = (mag * lower).sum(1) / lower.sum(1).clamp(min=1)
    scales = torch.clamp(torch.stack([hi, lo], 1), max=_CAP["topk-2bit"]).bfloat16()
    return scales, upper.to(torch.int32) | (values < 0).to(torch.int32) << 1


def _dequantize_2bit(code: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    mag = torch.where(code & 1 == 1, scale[:, 0], scale[:, 1])
    return torch.where(code & 2 == 2, -mag, mag)


def _quantize_fp4(values: torch.Tensor, valid: torch.Tensor):
    """topk-fp4: fp4-e2m1 codes, the chunk's scale its absmax (its first value's) / 6."""
    scale, s = _scale(values[:, 0].abs(), "topk-fp4")
    return scale[:, None], _nibbles(values, s, "topk-fp4").to(torch.int32)


def _dequantize_fp4(code: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _table("topk-fp4", code.device)[code] * scale[:, 0]


_QUANTIZE = {"topk-2bit": (_quantize_2bit, _dequantize_2bit),
             "topk-fp4": (_quantize_fp4, _dequantize_fp4)}


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


def encode(x: torch.Tensor, codec: str, block: "int | Chunks" = 64, density: float = DENSITY,
           compiled: bool | None = None) -> torch.Tensor:
    """x's bytes in the codec. density: topk codecs only (a Chunks block brings its own).
    compiled: torch.compile (Triton kernels on CUDA) rather than eager; None: compiled on CUDA,
    eager elsewhere. The bytes are the same either way; the topk codecs always run eager."""
    x = x.detach().reshape(-1).float()
    if codec in ("fp32", "bf16"):  # one copy each, compiled or not
        finite = torch.isfinite(x).all()
        payload = (x.clone() if codec == "fp32" else x.bfloat16()).view(torch.uint8)
    elif codec in SPARSE:
        finite = torch.isfinite(x).all()
        chunk, density, bits, _ = _topk(codec, block, density)
        payload = sparse.encode(x, chunk, density, bits, _QUANTIZE[codec][0]) if finite else None
    elif (fast := _triton(x, block, compiled)) is not None:
        payload, finite = fast.encode(x.contiguous(), payload_bytes(codec, x.numel(), block),
                                      block, _TOP[codec], _CAP[codec], _mids(codec))
    else:
        payload, finite = _run(_encode_blocks, codec, block, bool(compiled), x)
    if not finite:
        raise NonFiniteError("the tensor to encode holds NaN or inf")
    return payload


def decode(payload: torch.Tensor, n: int, codec: str, block: "int | Chunks" = 64,
           density: float = DENSITY, compiled: bool | None = None) -> torch.Tensor:
    """n fp32 values from encode()'s bytes; density and compiled as for encode()."""
    size = payload_bytes(codec, n, block, density)
    if payload.numel() != size:
        raise ValueError(f"a {codec} payload of {n} values has {size} bytes, got {payload.numel()}")
    if codec == "fp32":
        return payload.view(torch.float32).clone()
    if codec == "bf16":
        return payload.view(torch.bfloat16).float()
    if codec in SPARSE:
        return sparse.decode(payload, n, *_topk(codec, block, density), _QUANTIZE[codec][1])
    fast = _triton(payload, block, compiled)
    if fast is not None:
        table = _table(codec, payload.device) if codec in _LEVELS else None
        return fast.decode(payload.contiguous(), n, block, table)
    scale = payload[: 2 * math.ceil(n / block)].view(torch.bfloat16)
    return _run(_decode_blocks, codec, block, bool(compiled), payload, scale)[:n]
