"""Codecs for what crosses the outer link: fp32, bf16, int8, two 4-bit floats, and two sparse
codecs (top-k with 2-bit or 4-bit values). Each is one record in CODEC_RECORDS, of its family:
`Raw` (a dtype copy: fp32, bf16), `Blocks` (block-scaled codes on a quantized.Grid: int8, fp4-*;
the math in comm/quantized.py, the CUDA kernels in codecs_triton.py) or `TopK` (a chunk's largest
values, comm/sparse.py). The record owns the codec's bytes, encode, decode, documented error and
whether it takes the two-phase exchange; payload_bytes, encode and decode below look it up by
name and call it.

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

`compiled=True` runs the block-scaled codecs through torch.compile, and on CUDA (where it is the
default, compiled=None) through the Triton kernels: bitwise the eager bytes and values
(comm/quantized.py says how). fp32 and bf16 are one copy each way, and the topk codecs run eager.
"""

from __future__ import annotations

import functools
import math
from dataclasses import KW_ONLY, dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from lowband.comm import quantized, sparse
from lowband.comm.quantized import Grid
from lowband.comm.sparse import CHUNK, DENSITY, Chunks  # noqa: F401 (CHUNK: for importers)

SCALE_BYTES = 2  # one bf16 scale per block


class NonFiniteError(ValueError):
    pass


@dataclass(frozen=True)
class Codec:
    """One codec's facts and behaviour, read by the collectives, the config, the CLI's help and
    the planner. A family (Raw, Blocks, TopK) gives `_encode`, `_decode` and `max_error`; a new
    family is a subclass with those (and `payload_bytes` if the dense count below does not hold).

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
        return self.value_bytes + (SCALE_BYTES * self.scales / block if self.scaled else 0.0)

    def payload_bytes(self, n: int, block: "int | Chunks" = 64, density: float = DENSITY) -> int:
        """The exact size of encode()'s output for n values: value_bytes a value (the last byte
        of 4-bit codes half full) and its scales a block."""
        scales = SCALE_BYTES * self.scales * math.ceil(n / block) if self.scaled else 0
        return math.ceil(n * self.value_bytes) + scales

    def encode(self, x: torch.Tensor, block: "int | Chunks" = 64, density: float = DENSITY,
               compiled: bool | None = None) -> torch.Tensor:
        x = x.detach().reshape(-1).float()
        payload, finite = self._encode(x, block, density, compiled)
        if not finite:
            raise NonFiniteError("the tensor to encode holds NaN or inf")
        return payload

    def decode(self, payload: torch.Tensor, n: int, block: "int | Chunks" = 64,
               density: float = DENSITY, compiled: bool | None = None) -> torch.Tensor:
        size = self.payload_bytes(n, block, density)
        if payload.numel() != size:
            raise ValueError(f"a {self.name} payload of {n} values has {size} bytes, "
                             f"got {payload.numel()}")
        return self._decode(payload, n, block, density, compiled)

    def max_error(self, x: torch.Tensor, block: "int | Chunks" = 64,
                  density: float = DENSITY) -> torch.Tensor:
        """The documented worst-case error on each value of the flat fp32 x (float64), which
        decode(encode(x)) keeps within (tests/test_codec_records.py)."""
        raise NotImplementedError(self._no_family())

    def _encode(self, x, block, density, compiled) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload, whether all of x is finite) for the flat fp32 x."""
        raise NotImplementedError(self._no_family())

    def _decode(self, payload, n, block, density, compiled) -> torch.Tensor:
        raise NotImplementedError(self._no_family())

    def _no_family(self) -> str:
        return f"codec {self.name}: a bare Codec has no encoding (make it a Raw, Blocks or TopK)"


@dataclass(frozen=True)
class Raw(Codec):
    """The values as `dtype`, one copy each way (compiled or not). Error: half a unit in the
    dtype's last place (none for fp32)."""
    _: KW_ONLY
    dtype: torch.dtype

    def _encode(self, x, block, density, compiled):
        return x.to(self.dtype, copy=True).view(torch.uint8), torch.isfinite(x).all()

    def _decode(self, payload, n, block, density, compiled):
        return payload.view(self.dtype).to(torch.float32, copy=True)

    def max_error(self, x, block=64, density=DENSITY):
        f = torch.finfo(self.dtype)
        return (x.abs().double() + f.tiny) * (f.eps / 2)


@dataclass(frozen=True)
class Blocks(Codec):
    """Block-scaled codes on `grid` (comm/quantized.py): a bf16 scale a block, then a code a
    value; compiled: torch.compile, or on CUDA the Triton kernels."""
    _: KW_ONLY
    grid: Grid

    def _encode(self, x, block, density, compiled):
        size = self.payload_bytes(x.numel(), block)
        return quantized.encode(x, self.name, self.grid, block, size, compiled)

    def _decode(self, payload, n, block, density, compiled):
        return quantized.decode(payload, n, self.name, self.grid, block, compiled)

    def max_error(self, x, block=64, density=DENSITY):
        return quantized.max_error(x, self.grid, block)


_SUM_NOT_SPARSE = ("the ranks keep different values of a chunk, so their sum is not top-k sparse "
                   "and re-encoding it would drop what the others sent")


@dataclass(frozen=True)
class TopK(Codec):
    """A chunk's largest values, each coded by `quantize`/`dequantize` (comm/sparse.py's value
    codes, with `grid`) in round(8 value_bytes) bits beside its index; `scales` bf16 scales a
    chunk. `block`: the chunk (an int, with `density`) or a Chunks(size, density). Error: a value
    decodes to zero or, with its own sign, to at most its chunk's largest magnitude (the exact
    values: tests/test_sparse_codecs.py)."""
    sparse: bool = True
    two_phase: bool = False
    no_two_phase: str = _SUM_NOT_SPARSE
    _: KW_ONLY
    grid: Grid
    quantize: Callable
    dequantize: Callable

    def _layout(self, block, density) -> tuple[int, float, int, int]:
        """The chunk, density, code bits and bf16 scales a chunk."""
        if isinstance(block, Chunks):
            block, density = block.size, block.density
        return block, density, round(8 * self.value_bytes), self.scales

    def bytes_per_value(self, block=64, density=DENSITY):
        chunk = self._layout(block, density)[0]  # 8 chunks: their words end on a byte
        return self.payload_bytes(8 * chunk, block, density) / (8 * chunk)

    def payload_bytes(self, n, block=64, density=DENSITY):
        return sparse.size(n, *self._layout(block, density))

    def _encode(self, x, block, density, compiled):
        finite = torch.isfinite(x).all()
        chunk, density, bits, _ = self._layout(block, density)
        quantize = functools.partial(self.quantize, self.grid)
        return (sparse.encode(x, chunk, density, bits, quantize) if finite else None), finite

    def _decode(self, payload, n, block, density, compiled):
        dequantize = functools.partial(self.dequantize, self.grid)
        return sparse.decode(payload, n, *self._layout(block, density), dequantize)

    def max_error(self, x, block=64, density=DENSITY):
        chunk, n = self._layout(block, density)[0], x.numel()
        absmax = F.pad(x.abs(), (0, (-n) % chunk)).view(-1, chunk).amax(1)
        return absmax.double().repeat_interleave(chunk)[:n] * (1 + 2.0 ** -7) + 2.0 ** -149


E2M1 = Grid(6.0, (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0))  # OCP MX FP4's magnitudes
_TOPK = "top --density of each --sparse-chunk values by magnitude, "
CODEC_RECORDS = {c.name: c for c in (
    Raw("fp32", 4.0, False, "full precision (a ring all-reduce)", dtype=torch.float32,
        two_phase=False, no_two_phase="an all-reduce sums it exactly on the way, in fewer bytes"),
    Raw("bf16", 2.0, False, "bfloat16", dtype=torch.bfloat16),
    Blocks("int8", 1.0, True, "8-bit integers, a bf16 scale per block", grid=Grid(127.0)),
    Blocks("fp4-e3m0", 0.5, True, "4-bit floats, 3-bit exponent (the Streaming DiLoCo paper's)",
           grid=Grid(1.0, (0.0,) + tuple(2.0 ** (k - 7) for k in range(1, 8)))),
    Blocks("fp4-e2m1", 0.5, True, "4-bit floats, OCP MX FP4", grid=E2M1),
    # value_bytes of a topk codec: a kept value's code, before its index
    TopK("topk-2bit", 0.25, True, _TOPK + "2 bits each + an index (SparseLoCo's)", scales=2,
         grid=Grid(1.0), quantize=sparse.quantize_2bit, dequantize=sparse.dequantize_2bit),
    TopK("topk-fp4", 0.5, True, _TOPK + "fp4-e2m1 each + an index", grid=E2M1,
         quantize=sparse.quantize_levels, dequantize=sparse.dequantize_levels),
)}
CODECS = tuple(CODEC_RECORDS)  # the names
SPARSE = tuple(name for name, c in CODEC_RECORDS.items() if c.sparse)
TWO_PHASE = tuple(name for name, c in CODEC_RECORDS.items() if c.two_phase)


def payload_bytes(codec: str, n: int, block: "int | Chunks" = 64, density: float = DENSITY) -> int:
    """The exact size of encode()'s output for n values (density: topk codecs only), as the
    codec's record counts it (a topk codec's layout is comm/sparse.py's)."""
    return CODEC_RECORDS[codec].payload_bytes(n, block, density)


def encode(x: torch.Tensor, codec: str, block: "int | Chunks" = 64, density: float = DENSITY,
           compiled: bool | None = None) -> torch.Tensor:
    """x's bytes in the codec. density: topk codecs only (a Chunks block brings its own).
    compiled: torch.compile (Triton kernels on CUDA) rather than eager; None: compiled on CUDA,
    eager elsewhere. The bytes are the same either way; the topk codecs always run eager."""
    return CODEC_RECORDS[codec].encode(x, block, density, compiled)


def decode(payload: torch.Tensor, n: int, codec: str, block: "int | Chunks" = 64,
           density: float = DENSITY, compiled: bool | None = None) -> torch.Tensor:
    """n fp32 values from encode()'s bytes; density and compiled as for encode()."""
    return CODEC_RECORDS[codec].decode(payload, n, block, density, compiled)
