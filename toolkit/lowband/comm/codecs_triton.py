"""The quantized codecs as Triton kernels on CUDA: one pass over the values each way.

quantized.py defines the block-scaled codes and runs them eagerly (and through torch.compile);
on a GPU this file does the same arithmetic in one kernel for encode and one for decode, so each
value is read once and the payload written once (torch.compile's graph made 7 kernels of the
encode, reading the input four times). Bitwise the eager codec on the same device and on the CPU:
divisions are correctly rounded (`div_rn`), rounding is half-to-even, the bf16 scale is
rounded to nearest even on its bits, and decoding multiplies the same fp32 code value by the
same fp32 scale (checked on a GPU by benchmarks/gpu_codecs.py, and on the CPU through Triton's
interpreter by tests/test_codecs_triton.py).

The fp4 encode without a division a value (_encode_fp4, MAG "search"): the code's magnitude
counts the midpoints m_k with div_rn(|x|, s) > m_k, which holds iff bits(|x|) > bits(m_k s),
the fp32 bit patterns compared as integers (they order non-negative floats). Why: div_rn(a, s)
is monotone in a and exceeds m iff a / s > m + u/2, u the fp32 spacing above m (a tie rounds
to m, whose last mantissa bit is 0: midpoints have at most 3 significant bits), i.e. iff
a > m s + s u/2. p = m s is exact: m's lowest bit is at least 2^-8 and s is a bf16 number of
at most the cap, so p is a multiple of 2^-141 of at most 11 bits, finite. And no fp32 number
lies in (p, m s + s u/2]: with e, e_m the exponents of s and m, s u/2 < 2^(e + e_m - 23), at most
the spacing above a normal p, and below 2^-150 (half the subnormals' spacing) where p is
subnormal. So a > m s + s u/2 iff a > p. The 7 products are sorted: 3 comparisons find the
count. tests/test_codecs_triton.py checks the step for every bf16 scale, and the kernels on
edge cases. Values are read a pair (one code byte) at a time: one 64-bit load (PAIRS) or two
strided 32-bit loads.

Used for blocks of a power-of-two size of at least 2 (pairs of 4-bit codes then never cross a
block); other sizes take the torch.compile path. Constants (the largest code, the scale cap,
the fp4 midpoints and levels) come from the codec's quantized.Grid as arguments.
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
def _bf16_scale(absmax, top, cap):
    """(the blocks' bf16 scales as bits, the fp32 divisors: 1 where the scale is 0)."""
    scale = tl.minimum(tl.div_rn(absmax, top), cap)
    # to bf16, rounding to nearest even on the bits (as c10 does; NaN and inf are refused)
    bits = scale.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    s = (bits << 16).to(tl.float32, bitcast=True)
    return bits, tl.where(s > 0, s, 1.0)


@triton.jit
def _encode(x_ptr, out_ptr, bad_ptr, n, nb, top, cap, m0, m1, m2, m3, m4, m5, m6,
            BLOCK: tl.constexpr, ROWS: tl.constexpr, FP4: tl.constexpr):
    """int8, and fp4 as first written (a division per value, codes paired by reshape/split)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    idx = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    inside = idx < n
    x = tl.load(x_ptr + idx, mask=inside, other=0.0)
    ax = tl.abs(x)
    bad = tl.sum(tl.sum((inside & ~(ax < float("inf"))).to(tl.int32), axis=1), axis=0)
    tl.atomic_add(bad_ptr, bad, mask=bad > 0)
    bits, s = _bf16_scale(tl.max(ax, axis=1), top, cap)
    tl.store(out_ptr.to(tl.pointer_type(tl.uint16)) + rows, bits.to(tl.uint16), mask=rows < nb)
    s = s[:, None]
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
def _search(a, p0, p1, p2, p3, p4, p5, p6):
    """How many of the sorted p_k lie below a (all below 2^31), in 3 steps: the borrow of
    p - a (its sign bit) says a > p; a mask of it picks the next p by bit operations."""
    b2 = ((p3 - a).to(tl.int32, bitcast=True) >> 31).to(tl.uint32, bitcast=True)  # ~0: a > p3
    t = p1 ^ ((p1 ^ p5) & b2)
    b1 = ((t - a).to(tl.int32, bitcast=True) >> 31).to(tl.uint32, bitcast=True)
    lo = p0 ^ ((p0 ^ p4) & b2)
    t = lo ^ ((lo ^ (p2 ^ ((p2 ^ p6) & b2))) & b1)  # p0, p2, p4 or p6
    return (b2 & 4) | (b1 & 2) | ((t - a) >> 31)


@triton.jit
def _encode_fp4(x_ptr, out_ptr, bad_ptr, n, half, nbytes, nb, top, cap,
                m0, m1, m2, m3, m4, m5, m6, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                PAIRS: tl.constexpr, MAG: tl.constexpr):
    """fp4 on the values' bits, a pair of values (one code byte) at a time: half = n // 2,
    nbytes = (n + 1) // 2; MAG: "search" compares with the products, "div" divides."""
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    j = rows[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]  # pairs: 2j, 2j + 1
    xi = x_ptr.to(tl.pointer_type(tl.uint32))
    if PAIRS:  # one 64-bit load a pair (x 8-byte aligned): value 2j in the low word
        pair = tl.load(x_ptr.to(tl.pointer_type(tl.uint64)) + j, mask=j < half, other=0)
        lo, hi = pair.to(tl.uint32), (pair >> 32).to(tl.uint32)
        if pid == (n - 1) // (ROWS * BLOCK):  # the last program: an odd n's last value alone
            lo = tl.where(2 * j + 1 == n, tl.load(xi + (n - 1)), lo)
    else:  # two strided loads (the same cache lines)
        lo = tl.load(xi + 2 * j, mask=j < nbytes, other=0)
        hi = tl.load(xi + 2 * j + 1, mask=j < half, other=0)
    a_lo, a_hi = lo & 0x7FFFFFFF, hi & 0x7FFFFFFF
    amax = tl.max(tl.maximum(a_lo, a_hi), axis=1)  # bits order non-negative floats
    tl.atomic_add(bad_ptr + 0 * rows, 1, mask=amax >= 0x7F800000)  # NaN or inf in the block
    bits, s = _bf16_scale(amax.to(tl.float32, bitcast=True), top, cap)
    tl.store(out_ptr.to(tl.pointer_type(tl.uint16)) + rows, bits.to(tl.uint16), mask=rows < nb)
    s = s[:, None]
    if MAG == "div":
        q_lo = tl.div_rn(a_lo.to(tl.float32, bitcast=True), s)
        q_hi = tl.div_rn(a_hi.to(tl.float32, bitcast=True), s)
        mag_lo = _magnitude(q_lo, m0, m1, m2, m3, m4, m5, m6)
        mag_hi = _magnitude(q_hi, m0, m1, m2, m3, m4, m5, m6)
    else:  # the products' bits (exact, subnormal ones too: no flush to zero in Triton's fmul)
        p0 = (m0 * s).to(tl.uint32, bitcast=True)
        p1 = (m1 * s).to(tl.uint32, bitcast=True)
        p2 = (m2 * s).to(tl.uint32, bitcast=True)
        p3 = (m3 * s).to(tl.uint32, bitcast=True)
        p4 = (m4 * s).to(tl.uint32, bitcast=True)
        p5 = (m5 * s).to(tl.uint32, bitcast=True)
        p6 = (m6 * s).to(tl.uint32, bitcast=True)
        mag_lo = _search(a_lo, p0, p1, p2, p3, p4, p5, p6)
        mag_hi = _search(a_hi, p0, p1, p2, p3, p4, p5, p6)
    # the sign where x < 0: bits above -0.0's
    code = mag_lo.to(tl.uint32) | ((lo > 0x80000000).to(tl.uint32) << 3)
    code |= (mag_hi.to(tl.uint32) | ((hi > 0x80000000).to(tl.uint32) << 3)) << 4
    tl.store(out_ptr + 2 * nb + j, code.to(tl.uint8), mask=j < nbytes)


@triton.jit
def _decode(p_ptr, table_ptr, y_ptr, n, nb, BLOCK: tl.constexpr, SPAN: tl.constexpr,
            FP4: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * SPAN + tl.arange(0, SPAN)
    inside = i < n
    # the bf16 scale's bits, widened by a shift (Triton's interpreter converts subnormal bf16
    # wrongly)
    s = tl.load(p_ptr.to(tl.pointer_type(tl.uint16)) + i // BLOCK, mask=inside, other=0)
    s = (s.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    if FP4:
        byte = tl.load(p_ptr + 2 * nb + i // 2, mask=inside, other=0)
        nib = (byte >> ((i % 2) * 4).to(tl.uint8)) & 15
        q = tl.load(table_ptr + nib.to(tl.int32), mask=inside, other=0.0)
    else:
        q = tl.load(p_ptr + 2 * nb + i, mask=inside, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    tl.store(y_ptr + i, q * s, mask=inside)


# Tile sizes measured on an H100 (benchmarks/RESULTS.md): Triton's autotuner did no better over
# 8 configurations each and cost seconds at a run's first sync, so they are fixed
TILES_ENCODE = {"ROWS": 32}   # blocks an int8 encode program quantizes
TILES_DECODE = {"SPAN": 4096}  # values a decode program writes
# fp4 encode variants, timed side by side by benchmarks/gpu_codecs.py, checked bitwise by
# tests/test_codecs_triton.py (the bytes do not depend on the choice): "split" is _encode (a
# division a value, codes paired by reshape/split); the others _encode_fp4 (num_warps: 4 unless
# told), "pairs-div" dividing, the rest comparing with the products
FP4_VARIANTS = {
    "split": {"ROWS": 32},
    "pairs-div": {"ROWS": 32, "PAIRS": True, "MAG": "div"},
    "pairs": {"ROWS": 32, "PAIRS": True, "MAG": "search"},
    "pairs-r64": {"ROWS": 64, "PAIRS": True, "MAG": "search"},
    "pairs-w8": {"ROWS": 64, "PAIRS": True, "MAG": "search", "num_warps": 8},
    "strided": {"ROWS": 32, "PAIRS": False, "MAG": "search"},
}
# the variant encode() runs for fp4 unless told: the fastest fp4-e3m0 encode on an H200
# (2026-11-29, 2^28 values: encode + decode 61.9% of copy_ bandwidth against split's 46.5%;
# fp4-e2m1 62.8% against 49.4%), bitwise the CPU codec there for every variant
FP4_ENCODE = "pairs-r64"


def encode(x: torch.Tensor, size: int, block: int, top: float, cap: float,
           mids: tuple, tiles: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload of `size` bytes, whether all of x is finite) for the flat fp32 CUDA tensor x;
    mids: the 7 fp4 midpoints, or () for int8; tiles: as TILES_ENCODE, or for fp4 one of
    FP4_VARIANTS (the bytes do not depend on them)."""
    n = x.numel()
    nb = triton.cdiv(n, block)
    out = torch.empty(size, dtype=torch.uint8, device=x.device)
    bad = torch.zeros(1, dtype=torch.int32, device=x.device)
    tiles = dict(tiles or (FP4_VARIANTS[FP4_ENCODE] if mids else TILES_ENCODE))
    if n and mids and "PAIRS" in tiles:
        # the products' argument: midpoints of at most 3 significant bits, none below 2^-8
        assert all(m >= 2 ** -8 and m.as_integer_ratio()[0] < 8 for m in mids), mids
        tiles["PAIRS"] &= x.data_ptr() % 8 == 0  # 64-bit loads need 8-byte alignment
        grid = (triton.cdiv(nb, tiles["ROWS"]),)
        _encode_fp4[grid](x, out, bad, n, n // 2, (n + 1) // 2, nb, top, cap, *mids, BLOCK=block,
                          **tiles)
    elif n:
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
