"""The topk codecs (codecs.py's `TopK` records): which values of each chunk travel, the bytes
they travel in, and their value codes (codecs.py says how each codes a value).

x is cut into chunks of `chunk` values (the last may be short). A chunk of L values keeps
k = max(1, floor(density L + 1/2)) of them: the largest in magnitude, a tie going to the lower
index (a stable sort, so the choice is the same on every machine). The payload is the chunks'
bf16 scales (`scales` a chunk, chunk by chunk), then one bit stream of words, one a kept value,
chunk by chunk and in index order within a chunk: the value's code in the low `bits` bits, its
index in the chunk above them in ceil(log2 chunk) bits; word i sits at bits [i w, (i + 1) w)
of the stream, least significant bit first, bit 0 of a byte its lowest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lowband.comm import quantized
from lowband.comm.quantized import Grid

DENSITY = 0.02  # the share of each chunk's values sent, unless told
CHUNK = 4096  # values a chunk, unless told


@dataclass(frozen=True)
class Chunks:
    """A topk codec's `block`: `size` values a chunk, the largest `density` share of each sent.
    Code that carries (codec, block) pairs, as comm/exchanges.py does, carries the density
    with them; an int block given to a topk codec means Chunks(block, density)."""
    size: int = CHUNK
    density: float = DENSITY


def kept(length: int, density: float) -> int:
    """How many of a chunk's `length` values travel."""
    if not 0 < density <= 1:
        raise ValueError(f"density must lie in (0, 1], got {density}")
    return max(1, math.floor(density * length + 0.5)) if length else 0


def _counts(n: int, chunk: int, density: float, device) -> torch.Tensor:
    """The kept count of each chunk of n values."""
    full, rest = divmod(n, chunk)
    have = [kept(chunk, density)] * full + ([kept(rest, density)] if rest else [])
    return torch.tensor(have, dtype=torch.long, device=device)


def size(n: int, chunk: int, density: float, bits: int, scales: int) -> int:
    """The payload's bytes for n values."""
    full, rest = divmod(n, chunk)
    words = full * kept(chunk, density) + kept(rest, density)
    return 2 * scales * math.ceil(n / chunk) + (words * (bits + _index_bits(chunk)) + 7) // 8


def _index_bits(chunk: int) -> int:
    if not 1 <= chunk <= 2 ** 24:  # a word (code and index) fits an int32
        raise ValueError(f"a topk codec's chunk must lie in 1..2^24, got {chunk}")
    return (chunk - 1).bit_length()


def top(x: torch.Tensor, chunk: int, density: float):
    """Each chunk's kept values of the flat tensor x: (values, index, valid), each of shape
    (chunks, k), k a full chunk's count; in each row the largest magnitude first; `valid`
    marks the first kept(...) entries of each row (a short last chunk keeps fewer)."""
    n = x.numel()
    rows = F.pad(x, (0, (-n) % chunk)).view(-1, chunk)  # padding zeros sort after real ones
    k = kept(chunk, density)
    index = torch.sort(rows.abs(), dim=1, descending=True, stable=True).indices[:, :k]
    valid = torch.arange(k, device=x.device) < _counts(n, chunk, density, x.device)[:, None]
    return rows.gather(1, index), index, valid


def encode(x: torch.Tensor, chunk: int, density: float, bits: int, quantize) -> torch.Tensor:
    """The payload of the finite flat tensor x. quantize(values, valid) -> (bf16 scales, one row
    a chunk; int32 codes below 2^bits), of top()'s values."""
    values, index, valid = top(x, chunk, density)
    scales, codes = quantize(values, valid)
    order = torch.where(valid, index, chunk).argsort(dim=1)  # index order, the valid first
    words = (codes | index.to(torch.int32) << bits).gather(1, order)[valid]
    return torch.cat([scales.reshape(-1).view(torch.uint8), pack(words, bits + _index_bits(chunk))])


def decode(payload: torch.Tensor, n: int, chunk: int, density: float, bits: int, scales: int,
           dequantize) -> torch.Tensor:
    """n fp32 values from encode()'s payload, zero where nothing was sent. dequantize(codes,
    scales) -> values, given each kept value's code and its chunk's scales (fp32, a row each)."""
    c = math.ceil(n / chunk)
    scale = payload[: 2 * scales * c].view(torch.bfloat16).float().view(c, scales)
    have = _counts(n, chunk, density, payload.device)
    words = unpack(payload[2 * scales * c:], int(have.sum()), bits + _index_bits(chunk))
    row = torch.repeat_interleave(have)  # each word's chunk
    out = torch.zeros(c * chunk, device=payload.device)
    out[row * chunk + (words >> bits)] = dequantize(words & ((1 << bits) - 1), scale[row])
    return out[:n]


def pack(words: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative int32 words below 2^width as ceil(len x width / 8) bytes."""
    bits = (words.reshape(-1, 1) >> torch.arange(width, device=words.device, dtype=torch.int32)) & 1
    bits = F.pad(bits.reshape(-1).to(torch.uint8), (0, (-bits.numel()) % 8)).view(-1, 8)
    return (bits << torch.arange(8, device=words.device, dtype=torch.uint8)).sum(1).to(torch.uint8)


def unpack(stream: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """The first `count` words of `width` bits of pack()'s bytes, as int32."""
    bits = (stream.reshape(-1, 1) >> torch.arange(8, device=stream.device, dtype=torch.uint8)) & 1
    bits = bits.reshape(-1)[: count * width].view(count, width).to(torch.int32)
    shifts = torch.arange(width, device=stream.device, dtype=torch.int32)
    return (bits << shifts).sum(1).to(torch.int32)


# The value codes: quantize(grid, values, valid) -> (bf16 scales, one row a chunk; int32 codes)
# of top()'s values, and dequantize(grid, codes, scales) -> values, as encode() and decode()
# take them with the record's grid bound.

def quantize_2bit(grid: Grid, values: torch.Tensor, valid: torch.Tensor):
    """topk-2bit: bit 0 marks the upper half of a chunk's kept values by magnitude, bit 1 the
    sign; the chunk's scales (hi, lo) are the halves' mean magnitudes (at most grid.cap)."""
    half = (valid.sum(1, keepdim=True) + 1) // 2
    upper = torch.arange(values.shape[1], device=values.device) < half
    lower = valid & ~upper
    mag = values.abs().double()  # a sum of fp32 maxima would overflow fp32
    hi = (mag * upper).sum(1) / upper.sum(1).clamp(min=1)
    lo = (mag * lower).sum(1) / lower.sum(1).clamp(min=1)
    scales = torch.clamp(torch.stack([hi, lo], 1), max=grid.cap).bfloat16()
    return scales, upper.to(torch.int32) | (values < 0).to(torch.int32) << 1


def dequantize_2bit(grid: Grid, code: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    mag = torch.where(code & 1 == 1, scale[:, 0], scale[:, 1])
    return torch.where(code & 2 == 2, -mag, mag)


def quantize_levels(grid: Grid, values: torch.Tensor, valid: torch.Tensor):
    """topk-fp4: the grid's 4-bit codes, the chunk's scale its absmax (its first value's) / top."""
    scale, s = quantized.scale(values[:, 0].abs(), grid)
    return scale[:, None], quantized.nibbles(values, s, grid).to(torch.int32)


def dequantize_levels(grid: Grid, code: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return quantized.table(grid, code.device)[code] * scale[:, 0]
