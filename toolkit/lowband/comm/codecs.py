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
4-bit codes round to the nearest magnitude and pack two to a byte (value 2i in the low nibble,
2i+1 in the high one), so the bytes on the wire are real. Bytes for n values:
  fp32 4n, bf16 2n, int8 n + 2 ceil(n/block), fp4 ceil(n/2) + 2 ceil(n/block).
Worst-case error per value, s the block's scale: int8 s/2; fp4-e2m1 s (between 4 and 6);
fp4-e3m0 |x|/3 for |x| >= 2^-6 s, else |x| (flushed to zero or rounded up to 2^-6 s);
plus the bf16 rounding of s (2^-8 relative).
Inputs holding NaN or inf are refused with NonFiniteError: a broken pseudo-gradient must not be
quietly turned into numbers.
"""

from __future__ import annotations

import math

import torch

CODECS = ("fp32", "bf16", "int8", "fp4-e3m0", "fp4-e2m1")

_LEVELS = {
    "fp4-e2m1": torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]),
    "fp4-e3m0": torch.tensor([0.0] + [2.0 ** (k - 7) for k in range(1, 8)]),
}


class NonFiniteError(ValueError):
    pass


def payload_bytes(codec: str, n: int, block: int = 64) -> int:
    """The exact size of encode()'s output for n values."""
    scales = 2 * math.ceil(n / block)
    return {"fp32": 4 * n, "bf16": 2 * n, "int8": n + scales}.get(codec, (n + 1) // 2 + scales)


def _blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad to whole blocks; return (blocks, bf16 absmax per block as fp32)."""
    n = x.numel()
    padded = torch.nn.functional.pad(x, (0, (-n) % block)).view(-1, block)
    absmax = padded.abs().amax(dim=1)
    return padded, absmax


def encode(x: torch.Tensor, codec: str, block: int = 64) -> torch.Tensor:
    x = x.detach().reshape(-1).float()
    if not torch.isfinite(x).all():
        raise NonFiniteError("the tensor to encode holds NaN or inf")
    if codec == "fp32":
        return x.clone().view(torch.uint8)
    if codec == "bf16":
        return x.bfloat16().view(torch.uint8)
    n = x.numel()
    padded, absmax = _blocks(x, block)
    top = 127.0 if codec == "int8" else float(_LEVELS[codec][-1])
    scale = (absmax / top).bfloat16()
    s = scale.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))[:, None]
    if codec == "int8":
        codes = torch.clamp(torch.round(padded / safe), -127, 127).to(torch.int8).view(torch.uint8)
        codes = codes.reshape(-1)[:n]
    else:
        levels = _LEVELS[codec].to(x.device)
        mids = (levels[1:] + levels[:-1]) / 2
        mag = torch.bucketize((padded.abs() / safe).reshape(-1)[:n], mids).to(torch.uint8)
        nib = mag | ((padded.reshape(-1)[:n] < 0).to(torch.uint8) << 3)
        nib = torch.nn.functional.pad(nib, (0, n % 2))
        codes = nib[0::2] | (nib[1::2] << 4)
    return torch.cat([scale.view(torch.uint8), codes])


def decode(payload: torch.Tensor, n: int, codec: str, block: int = 64) -> torch.Tensor:
    if payload.numel() != payload_bytes(codec, n, block):
        raise ValueError(f"a {codec} payload of {n} values has {payload_bytes(codec, n, block)} "
                         f"bytes, got {payload.numel()}")
    if codec == "fp32":
        return payload.view(torch.float32).clone()
    if codec == "bf16":
        return payload.view(torch.bfloat16).float()
    nscale = 2 * math.ceil(n / block)
    scale, codes = payload[:nscale].view(torch.bfloat16).float(), payload[nscale:]
    per_value = scale.repeat_interleave(block)[:n]
    if codec == "int8":
        return codes.view(torch.int8).float() * per_value
    nib = torch.stack([codes & 0xF, codes >> 4], dim=1).reshape(-1)[:n]
    mag = _LEVELS[codec].to(payload.device)[(nib & 7).long()]
    sign = 1.0 - 2.0 * (nib >> 3).float()
    return sign * mag * per_value
