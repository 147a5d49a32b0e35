"""The quantized codecs as two Triton kernels on CUDA: one pass over the values each way.

codecs.py defines the codecs and runs them eagerly (and through torch.compile); on a GPU this
file does the same arithmetic in one kernel for encode and one for decode, so each value is
read once and the payload written once (torch.compile's graph made 7 kernels of the encode,
reading the input four times). Bitwise the eager codec on the same device and on the CPU:
divisions are correctly rounded (`div_rn`), rounding is half-to-even, the bf16 scale is
rounded to nearest even on its bits, and decoding multiplies the same fp32 code value by the
same fp32 scale (checked on a GPU by benchmarks/gpu_codecs.py, and on the CPU through Triton's
interpreter by tests/test_codecs_triton.py).

Used for blocks of a power-of-two size of at least 2 (pairs of 4-bit codes then never cross a
block); other sizes take the torch.compile path. Constants (the largest code, the scale cap,
the fp4 midpoints and levels) come from codecs.py as arguments.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def usable(block: int) -> bool:
    return block >= 2 and block & (block - 1) == 0


@triton.jit
def _magnitude(a, m0, m1, m2, m3, m4, m5, m6):
    """How many of the 7 midpoints lie below a (ties go to the smaller magnitude)."""
    return ((a > m0).to(tl.uint8) + (a > m1).to(tl.uint8) + (a > m2).to(tl.uint8)
            + (a > m3).to(tl.uint8) + (a > m4).to(tl.uint8) + (a > m5).to(tl.uint8)
            + (a > m6).to(tl.uint8))


@triton.jit
def _encode(x_ptr, out_ptr, bad_ptr, n, nb, top, cap, m0, m1, m2, m3, m4, m5, m6,
            BLOCK: tl.constexpr, ROWS: tl.constexpr, FP4: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    idx = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    inside = idx < n
    x = tl.load(x_ptr + idx, mask=inside, other=0.0)
    ax = tl.abs(x)
    bad = tl.sum(tl.sum((inside & ~(ax < float("inf"))).to(tl.int32), axis=1), axis=0)
    tl.atomic_add(bad_ptr, bad, mask=bad > 0)
    scale = tl.minimum(tl.div_rn(tl.max(ax, axis=1), top), cap)
    # to bf16, rounding to nearest even on the bits (as c10 does; NaN and inf are refused)
    bits = scale.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    tl.store(out_ptr.to(tl.pointer_type(tl.uint16)) + rows, bits.to(tl.uint16), mask=rows < nb)
    s = (bits << 16).to(tl.float32, bitcast=True)
    s = tl.where(s > 0, s, 1.0)[:, None]
    if FP4:
        mag = _magnitude(tl.div_rn(ax, s), m0, m1, m2, m3, m4, m5, m6)
        nib = mag | ((x < 0).to(tl.uint8) << 3)
        lo, hi = tl.split(tl.reshape(nib, (ROWS, BLOCK // 2, 2)))  # value 2i in the low nibble
        at = rows[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
        tl.store(out_ptr + 2 * nb + at, lo | (hi << 4), mask=at < (n + 1) // 2)
    else:
        # round half to even by adding and taking away 1.5 * 2^23 (exact for |v| < 2^22; here
        # |v| <= 128): the fp32 add rounds to an integer, as torch.round does
        q = (tl.div_rn(x, s) + 12582912.0) - 12582912.0
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(out_ptr + 2 * nb + idx, q.to(tl.int8).to(tl.uint8, bitcast=True), mask=inside)


@triton.jit
def _decode(p_ptr, table_ptr, y_ptr, n, nb, BLOCK: tl.constexpr, SPAN: tl.constexpr,
            FP4: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * SPAN + tl.arange(0, SPAN)
    inside = i < n
    s = tl.load(p_ptr.to(tl.pointer_type(tl.bfloat16)) + i // BLOCK, mask=inside, other=0.0)
    if FP4:
        byte = tl.load(p_ptr + 2 * nb + i // 2, mask=inside, other=0)
        nib = (byte >> ((i % 2) * 4).to(tl.uint8)) & 15
        q = tl.load(table_ptr + nib.to(tl.int32), mask=inside, other=0.0)
    else:
        q = tl.load(p_ptr + 2 * nb + i, mask=inside, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    tl.store(y_ptr + i, q * s.to(tl.float32), mask=inside)


# Tile sizes measured on an H100 (benchmarks/RESULTS.md): Triton's autotuner did no better over
# 8 configurations each and cost seconds at a run's first sync, so they are fixed
TILES_ENCODE = {"ROWS": 32}   # blocks an encode program quantizes
TILES_DECODE = {"SPAN": 4096}  # values a decode program writes


def encode(x: torch.Tensor, size: int, block: int, top: float, cap: float,
           mids: tuple, tiles: dict = TILES_ENCODE) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload of `size` bytes, whether all of x is finite) for the flat fp32 CUDA tensor x;
    mids: the 7 fp4 midpoints, or () for int8; tiles: as TILES_ENCODE (the bytes do not depend
    on them)."""
    n = x.numel()
    nb = triton.cdiv(n, block)
    out = torch.empty(size, dtype=torch.uint8, device=x.device)
    bad = torch.zeros(1, dtype=torch.int32, device=x.device)
    if n:
        m = mids or (0.0,) * 7
        _encode[(triton.cdiv(nb, tiles["ROWS"]),)](x, out, bad, n, nb, top, cap, *m, BLOCK=block,
                                                   FP4=bool(mids), **tiles)
    return out, bad[0] == 0


def decode(payload: torch.Tensor, n: int, block: int, table: torch.Tensor | None,
           tiles: dict = TILES_DECODE) -> torch.Tensor:
    """n fp32 values from a payload; table: the 16 fp4 values by code, or None for int8."""
    y = torch.empty(n, dtype=torch.float32, device=payload.device)
    if n:
        fp4 = table is not None
        table = table if fp4 else y  # unread for int8
        _decode[(triton.cdiv(n, tiles["SPAN"]),)](payload, table, y, n, triton.cdiv(n, block),
                                                  BLOCK=block, FP4=fp4, **tiles)
    return y
