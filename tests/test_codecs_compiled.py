"""Codecs under torch.compile: bytes and values bitwise equal to eager, one graph for all sizes.

On CPU inductor compiles C++ (gcc): about 35 s on a 2-core machine with a cold inductor cache (20 s
warm), nearly all of it compiling one encode and one decode graph for each (codec, block) below.
A torch.compile that fails here fails the tests: nothing is skipped.
"""

import pytest
import torch

from lowband.comm import NonFiniteError, decode, encode

pytestmark = pytest.mark.slow  # measured (--durations): README, Run the tests

SIZES = [1, 63, 64, 65, 1001, 4097, 0]
VARIANTS = [("int8", 64), ("int8", 32), ("fp4-e2m1", 64), ("fp4-e2m1", 128), ("fp4-e2m1", 7),
            ("fp4-e3m0", 64), ("fp4-e3m0", 32)]
MIDS = {"int8": [k + 0.5 for k in range(127)],  # ties: round half to even
        "fp4-e2m1": [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0],
        "fp4-e3m0": [2.0 ** -7] + [1.5 * 2.0 ** k for k in range(-6, 0)]}
TOP = {"int8": 127.0, "fp4-e2m1": 6.0, "fp4-e3m0": 1.0}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t  # -0.0 differs from 0.0


def values(codec: str, n: int, block: int, seed: int) -> torch.Tensor:
    """Wide-ranging values, then the awkward ones: exact ties between two levels (the block's
    largest value makes its scale exactly 1, 2 or 0.5), values just past a tie, signed zeros,
    subnormals, values near the fp32 maximum."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)
    mids = torch.tensor(MIDS[codec])
    for b, mult in zip(range(n // block), [1.0, 2.0, 0.5, 1.0]):
        above = torch.nextafter(mids, mids + 1)
        ties = torch.cat([mids, -mids, above, -above])
        ties = ties[torch.randperm(len(ties), generator=g)][: block - 1]
        x[b * block: b * block + len(ties)] = ties * mult
        x[b * block + len(ties)] = TOP[codec] * mult  # the scale: mult, exactly
    tail = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-38, -3e38, 3.4e38, 7e-20])[:n]
    x[n - len(tail):] = tail
    return x


@pytest.mark.parametrize("codec,block", VARIANTS)
def test_compiled_equals_eager_bitwise_with_one_graph(codec, block):
    for i, n in enumerate(SIZES):
        x = values(codec, n, block, seed=i)
        # the first size compiles; every other size must reuse that graph
        with torch.compiler.set_stance("default" if i == 0 else "fail_on_recompile"):
            payload = encode(x, codec, block, compiled=True)
            assert torch.equal(payload, encode(x, codec, block)), (codec, block, n)
            y = decode(payload, n, codec, block, compiled=True)
            assert torch.equal(bits(y), bits(decode(payload, n, codec, block))), (codec, block, n)
        assert y.shape == (n,) and torch.isfinite(y).all()


@pytest.mark.parametrize("codec", ["fp32", "bf16"])
def test_plain_codecs_take_compiled_too(codec):
    x = values("int8", 1001, 64, seed=3)
    payload = encode(x, codec, compiled=True)
    assert torch.equal(payload, encode(x, codec))
    y = decode(payload, 1001, codec, compiled=True)
    assert torch.equal(bits(y), bits(decode(payload, 1001, codec)))


@pytest.mark.parametrize("codec", ["int8", "fp4-e2m1", "fp4-e3m0"])
def test_ties_and_rounding_match_the_bucketize_definition(codec):
    """The codes are those of round-half-even (int8) and torch.bucketize over the midpoints
    (fp4: a tie goes to the smaller magnitude), from eager and compiled alike."""
    x = values(codec, 4097, 64, seed=7).clamp(-3e38, 3e38)  # no capped scale (see the last test)
    s = torch.nn.functional.pad(x, (0, 63)).view(-1, 64).abs().amax(1) / TOP[codec]
    s = torch.where(s > 0, s.bfloat16().float(), 1.0).repeat_interleave(64)[:4097]
    if codec == "int8":
        expect = torch.round(x / s).clamp(-127, 127).to(torch.int8).view(torch.uint8)
    else:
        mag = torch.bucketize(x.abs() / s, torch.tensor(MIDS[codec])).to(torch.uint8)
        nib = torch.nn.functional.pad(mag | (x < 0).to(torch.uint8) << 3, (0, 1))
        expect = nib[0::2] | nib[1::2] << 4
    for compiled in (False, True):
        codes = encode(x, codec, 64, compiled=compiled)[2 * 65:]
        assert torch.equal(codes, expect), (codec, compiled)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_tie_goes_to_the_smaller_magnitude(compiled):
    x = torch.tensor([6.0, 5.0, -5.0, 2.5, 0.25, 0.75, 5.0000005, 0.2499999])  # scale 1
    y = decode(encode(x, "fp4-e2m1", compiled=compiled), 8, "fp4-e2m1", compiled=compiled)
    assert y.tolist() == [6.0, 4.0, -4.0, 2.0, 0.0, 0.5, 6.0, 0.0]
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -126.5])  # int8 rounds half to even
    y = decode(encode(x, "int8", compiled=compiled), 6, "int8", compiled=compiled)
    assert y.tolist() == [127.0, 0.0, 2.0, 2.0, 0.0, -126.0]


@pytest.mark.parametrize("codec", ["int8", "fp4-e2m1", "fp4-e3m0"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_compiled_refuses_non_finite(codec, bad):
    x = torch.ones(1001)
    x[700] = bad
    with pytest.raises(NonFiniteError, match="NaN or inf"):
        encode(x, codec, 64, compiled=True)


@pytest.mark.parametrize("codec", ["int8", "fp4-e2m1", "fp4-e3m0"])
def test_values_at_the_fp32_maximum_stay_finite(codec):
    top = torch.finfo(torch.float32).max
    x = torch.tensor([top, -top, 3.39e38, 1.0, 0.0, -1e-45])
    for compiled in (False, True):
        y = decode(encode(x, codec, compiled=compiled), 6, codec, compiled=compiled)
        assert torch.isfinite(y).all()
        assert ((y[:3] - x[:3]).abs() <= 2 ** -7 * x[:3].abs()).all()
