"""Codecs: exact byte counts, error bounds, odd sizes, extreme values, non-finite input."""

import math

import pytest
import torch

from lowband.comm import CODECS, SPARSE, NonFiniteError, decode, encode, payload_bytes

DENSE = tuple(c for c in CODECS if c not in SPARSE)  # the topk codecs: tests/test_sparse_codecs.py
SIZES = [0, 1, 2, 3, 63, 64, 65, 1001]


def bound(x: torch.Tensor, codec: str, block: int) -> torch.Tensor:
    """The documented worst-case error per value (plus bf16 rounding of the block scale)."""
    n = x.numel()
    blocks = torch.nn.functional.pad(x.abs(), (0, (-n) % block)).view(-1, block).amax(1)
    amax = blocks.repeat_interleave(block)[:n]
    a = x.abs()
    slack = 2 ** -7 * a + 1e-30
    if codec == "fp32":
        return torch.zeros_like(x)
    if codec == "bf16":
        return 2 ** -8 * a
    if codec == "int8":
        return amax / 127 / 2 * (1 + 2 ** -7) + slack
    if codec == "fp4-e2m1":
        return amax / 6 * (1 + 2 ** -7) + slack
    return torch.where(a >= 2 ** -6 * amax, a / 3, a) * (1 + 2 ** -7) + slack  # fp4-e3m0


@pytest.mark.parametrize("codec", DENSE)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("block", [32, 64, 128])
def test_round_trip_within_bound_and_exact_bytes(codec, n, block):
    g = torch.Generator().manual_seed(n * 7 + block)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)
    if n > 10:
        x[5:9] = 0.0  # zeros stay exactly zero
    payload = encode(x, codec, block)
    assert payload.dtype == torch.uint8
    assert payload.numel() == payload_bytes(codec, n, block)
    expected = {"fp32": 4 * n, "bf16": 2 * n, "int8": n + 2 * math.ceil(n / block)}.get(
        codec, math.ceil(n / 2) + 2 * math.ceil(n / block))
    assert payload.numel() == expected
    y = decode(payload, n, codec, block)
    assert y.dtype == torch.float32 and y.shape == (n,)
    assert ((y - x).abs() <= bound(x, codec, block)).all()
    if n > 10:
        assert (y[5:9] == 0).all()


@pytest.mark.parametrize("codec", DENSE)
def test_extreme_values(codec):
    x = torch.tensor([3e38, -3e38, 1e-38, -1e-45, 0.0, 1.0, -2.5, 7e-20] * 9)
    y = decode(encode(x, codec), x.numel(), codec)
    assert torch.isfinite(y).all()
    assert ((y - x).abs() <= bound(x, codec, 64) * 1.01 + 1e-37).all()
    tiny = torch.full((100,), 1e-30)  # a block of tiny values keeps its scale
    assert torch.allclose(decode(encode(tiny, codec), 100, codec), tiny, rtol=0.01)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_is_refused(codec, bad):
    x = torch.ones(10)
    x[3] = bad
    with pytest.raises(NonFiniteError):
        encode(x, codec)


def test_fp4_packs_two_values_a_byte_and_levels_are_exact():
    x = torch.tensor([6.0, -6.0, 3.0, 0.5, 0.0, -1.5])
    p = encode(x, "fp4-e2m1", block=64)
    assert p.numel() == 2 + 3
    assert torch.equal(decode(p, 6, "fp4-e2m1"), x)  # on-grid values with scale 1 are exact
    x = torch.tensor([1.0, 0.5, 0.25, -2 ** -6, 0.0])
    assert torch.equal(decode(encode(x, "fp4-e3m0"), 5, "fp4-e3m0"), x)


def test_wrong_payload_size_is_refused():
    with pytest.raises(ValueError, match="bytes"):
        decode(torch.zeros(5, dtype=torch.uint8), 10, "fp4-e3m0")
