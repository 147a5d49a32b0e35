"""The block-scaled codes (codecs.py's `Blocks` records: int8, fp4-e2m1, fp4-e3m0; the topk-fp4
values, comm/sparse.py): a `Grid` says what a code is worth at scale 1, and this file turns a flat
fp32 tensor into scales and codes and back, eagerly, through torch.compile or (on CUDA) through
the Triton kernels of codecs_triton.py. codecs.py documents the codes, bytes and errors.

`compiled=True` runs the same functions through torch.compile: one graph per grid, block and
device for every size, bitwise the eager bytes and values (checked on CPU by
tests/test_codecs_compiled.py, on a GPU by benchmarks/gpu_codecs.py). On CUDA, compiled means two
hand-written Triton kernels (codecs_triton.py), one pass each way, and it is the default there
(compiled=None); elsewhere the default is eager.
"""

from __future__ import annotations

import functools
import itertools
import math
import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# Inductor drops a bf16 round trip and Triton divides approximately unless told to match eager.
_EAGER_NUMERICS = ("emulate_precision_casts", "eager_numerics.division_rounding",
                   "emulate_divison_rounding", "eager_numerics.disable_ftz")  # names vary by torch


def _bf16_below(v: float) -> float:
    unit = 2.0 ** (math.frexp(v)[1] - 8)  # bf16 keeps 8 significant bits
    return math.floor(v / unit) * unit


@dataclass(frozen=True)
class Grid:
    """A block-scaled code's values at scale 1: the integers up to `top` (no `levels`: int8's
    codes), or a sign and one of the 8 magnitudes `levels` (4-bit codes; `top` the largest).
    A block's scale is its absmax / top in bf16, at most `cap`: the largest bf16 number whose
    product with top stays below the fp32 maximum."""
    top: float
    levels: tuple = ()
    cap: float = field(init=False, repr=False)

    def __post_init__(self):
        levels = self.levels
        if levels and (len(levels) != 8 or levels[0] != 0 or levels[-1] != self.top
                       or list(levels) != sorted(levels)):
            raise ValueError(f"a 4-bit grid has 8 sorted levels from 0 to top, got {levels}")
        object.__setattr__(self, "cap", _bf16_below(torch.finfo(torch.float32).max / self.top))

    @property
    def mids(self) -> tuple:
        """The midpoints between neighbouring levels (() for int8)."""
        return tuple((lo + hi) / 2 for lo, hi in itertools.pairwise(self.levels))


def scale(absmax: torch.Tensor, grid: Grid) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks' bf16 scales from their largest magnitudes, and the fp32 divisors of their values
    (one a row; 1 where the scale is 0)."""
    # a divisor tensor, not a Python number: CUDA multiplies by the reciprocal of a scalar
    # divisor (one bit off at times), which would make the GPU's scales differ from the CPU's
    top = torch.full((), grid.top, device=absmax.device)
    bf16 = torch.clamp(absmax / top, max=grid.cap).bfloat16()
    s = bf16.float()
    return bf16, torch.where(s > 0, s, 1.0)[:, None]


def nibbles(v: torch.Tensor, s: torch.Tensor, grid: Grid) -> torch.Tensor:
    """4-bit codes of v / s: the count of midpoints between levels below |v| / s (ties go down,
    as torch.bucketize did), the sign in bit 3."""
    a = v.abs() / s
    mag = sum((a > m).to(torch.uint8) for m in grid.mids)
    return mag | (v < 0).to(torch.uint8) << 3


def table(grid: Grid, device) -> torch.Tensor:
    """A 4-bit code's value at scale 1 (code 8 + m is minus level m)."""
    return torch.tensor(grid.levels + tuple(-v for v in grid.levels), device=device)


def _encode_blocks(x: torch.Tensor, grid: Grid, block: int):
    """(payload, whether all of x is finite)."""
    n = x.numel()
    padded = F.pad(x, (0, (-n) % block)).view(-1, block)
    absmax = padded.abs().amax(dim=1)  # NaN or inf where the block holds one
    bf16, s = scale(absmax, grid)
    if not grid.levels:  # int8
        codes = torch.clamp(torch.round(padded / s), -127, 127).to(torch.int8).view(torch.uint8)
        size = n
    else:
        nib = nibbles(padded, s, grid)
        if block % 2:  # pairs cross blocks
            nib = F.pad(nib.view(-1), (0, nib.numel() % 2))
        nib = nib.reshape(-1, 2)  # value 2i in the low nibble
        codes = nib[:, 0] | nib[:, 1] << 4
        size = (n + 1) // 2
    # whole blocks into the cat and the cut after it: a cut before the cat copies the codes
    payload = torch.cat([bf16.view(torch.uint8), codes.reshape(-1)])
    return payload[: 2 * bf16.numel() + size], torch.isfinite(absmax).all()


def _decode_blocks(payload: torch.Tensor, bf16: torch.Tensor, grid: Grid, block: int):
    """The values of whole blocks (`bf16`: the payload's scale bytes as bf16), of which the
    caller keeps the first n. Each value's code byte is gathered by index (clamped: past the
    last code the values are junk the caller cuts), so the compiled graph holds no slice or pad
    whose bounds depend on the size (Inductor on CUDA could not lower those) and no loop whose
    length is not a multiple of the block (Inductor on CPU tiled such a loop into whole blocks
    and dropped the rest)."""
    nb = bf16.numel()
    i = torch.arange(nb * block, device=payload.device)
    per_byte = 2 if grid.levels else 1  # fp4: value 2k in the low nibble of byte k
    byte = payload[torch.clamp(2 * nb + i // per_byte, max=payload.numel() - 1)]
    if not grid.levels:  # int8: two's complement by arithmetic, not a view as int8
        u = byte.float()
        q = torch.where(u >= 128, u - 256, u)
    else:
        nib = (byte >> ((i % 2) * 4).to(torch.uint8)) & 15
        q = table(grid, payload.device)[nib.int()]
    return (q.view(nb, block) * bf16.float()[:, None]).view(-1)


@functools.cache
def _compiled(fn, name: str, grid: Grid, block: int):
    """fn compiled with grid and block as constants, sizes left open (unbacked: one graph for
    every size, 0 and 1 too). Its own code object: dynamo keeps graphs (8 at most) per code."""
    import torch._inductor.config as inductor

    name = f"{fn.__name__}_{name.replace('-', '_')}_{block}"
    code = fn.__code__.replace(co_name=name)
    own = types.FunctionType(code, fn.__globals__, name, (grid, block))
    known = inductor.get_config_copy()
    options = {k: True for k in _EAGER_NUMERICS if k in known}
    return torch.compile(own, fullgraph=True, options=options)


def _run(fn, name: str, grid: Grid, block: int, compiled: bool, *tensors: torch.Tensor):
    if not compiled:
        return fn(*tensors, grid, block)
    # fresh aliases, not views (dynamo guards on a view's base): the marks stay off the caller's
    tensors = tuple(t.detach() for t in tensors)
    for t in tensors:
        torch._dynamo.decorators.mark_unbacked(t, 0)
    return _compiled(fn, name, grid, block)(*tensors)


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


def encode(x: torch.Tensor, name: str, grid: Grid, block: int, size: int,
           compiled: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the `size` bytes of the flat fp32 x in codec `name`, whether all of x is finite)."""
    if (fast := _triton(x, block, compiled)) is not None:
        return fast.encode(x.contiguous(), size, block, grid.top, grid.cap, grid.mids)
    return _run(_encode_blocks, name, grid, block, bool(compiled), x)


def decode(payload: torch.Tensor, n: int, name: str, grid: Grid, block: int,
           compiled: bool | None) -> torch.Tensor:
    """n fp32 values from encode()'s bytes."""
    if (fast := _triton(payload, block, compiled)) is not None:
        return fast.decode(payload.contiguous(), n, block,
                           table(grid, payload.device) if grid.levels else None)
    bf16 = payload[: 2 * math.ceil(n / block)].view(torch.bfloat16)
    return _run(_decode_blocks, name, grid, block, bool(compiled), payload, bf16)[:n]


def max_error(x: torch.Tensor, grid: Grid, block: int) -> torch.Tensor:
    """The worst-case error on each value of the flat fp32 x (float64): s times half the gap
    between the two codes around |x| / s (int8: s/2), s its block's scale, plus what lies above
    top x s where the scale is capped, plus fp32 rounding (of |x| / s, and subnormal products)."""
    n = x.numel()
    absmax = F.pad(x.abs(), (0, (-n) % block)).view(-1, block).amax(1)
    s = scale(absmax, grid)[1].double().repeat_interleave(block)[:n]
    a = x.abs().double()
    half = torch.full_like(a, 0.5)
    if grid.levels:
        levels = torch.tensor(grid.levels, dtype=torch.float64)
        i = torch.bucketize((a / s).clamp(max=grid.top), levels).clamp(1, len(levels) - 1)
        half = (levels[i] - levels[i - 1]) / 2
    return s * half + (a - grid.top * s).clamp(min=0) + 2.0 ** -23 * a + 2.0 ** -149
