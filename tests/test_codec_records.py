"""Every record in CODEC_RECORDS (a new one included, with nothing to add here): its byte count
is encode()'s output, decode(encode(x)) keeps within the record's documented error, the
functions by name are the record's, and a codec added as one record works by its name."""

import pytest
import torch

from lowband.comm import codecs
from lowband.comm.codecs import CODEC_RECORDS, Blocks, Chunks, decode, encode, payload_bytes
from lowband.comm.quantized import Grid

SIZES = [0, 1, 2, 3, 63, 64, 65, 1001]
DENSE_BLOCKS = [7, 32, 64]
CHUNKS = [Chunks(64, 0.1), Chunks(7, 0.5), Chunks(1000, 0.02)]


def values(n: int, seed: int) -> torch.Tensor:
    """Wide-ranging values, then zeros, signed zeros, subnormals and values near the top of
    bf16's range (3.39e38: fp4-e3m0's scale is capped there)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)
    tail = torch.tensor([0.0, -0.0, 1e-45, -3e-39, 1e-38, 7e-20, -3.39e38, 3e38])[:n]
    x[n - len(tail):] = tail
    x[5:9] = 0.0
    return x


def blocks(c):
    return CHUNKS if c.sparse else DENSE_BLOCKS


@pytest.mark.parametrize("name", list(CODEC_RECORDS))
def test_bytes_and_round_trip_within_the_documented_error(name):
    c = CODEC_RECORDS[name]
    for block in blocks(c):
        for n in SIZES:
            x = values(n, seed=n)
            payload = c.encode(x, block)
            assert payload.dtype == torch.uint8, (name, block, n)
            assert payload.numel() == c.payload_bytes(n, block) == payload_bytes(name, n, block)
            y = c.decode(payload, n, block)
            assert y.dtype == torch.float32 and y.shape == (n,)
            err = (y.double() - x.double()).abs()
            bound = c.max_error(x, block)
            assert bound.shape == (n,) and (err <= bound).all(), (
                name, block, n, (err - bound).max())
            assert (y[5:9] == 0).all()
        # whole blocks: bytes_per_value is the payload's share of a value
        m = 8 * (block.size if c.sparse else block)
        assert c.bytes_per_value(block) == pytest.approx(c.payload_bytes(m, block) / m), block


@pytest.mark.parametrize("name", list(CODEC_RECORDS))
def test_the_functions_by_name_are_the_records(name):
    c = CODEC_RECORDS[name]
    block = blocks(c)[0]
    x = values(1001, seed=3)
    payload = encode(x, name, block)
    assert torch.equal(payload, c.encode(x, block))
    assert torch.equal(decode(payload, 1001, name, block), c.decode(payload, 1001, block))


def test_a_new_codec_is_one_record(monkeypatch):
    """A 4-bit code on a uniform grid (0..7), added as one record: the functions by name, the
    bytes and the error bound follow from it."""
    record = Blocks("fp4-uniform", 0.5, True, "4-bit integers", grid=Grid(7.0, tuple(
        float(k) for k in range(8))))
    monkeypatch.setitem(CODEC_RECORDS, record.name, record)
    x = values(1001, seed=5)
    payload = encode(x, "fp4-uniform", 64)
    assert payload.numel() == payload_bytes("fp4-uniform", 1001, 64) == 501 + 2 * 16
    y = decode(payload, 1001, "fp4-uniform", 64)
    assert ((y.double() - x.double()).abs() <= record.max_error(x, 64)).all()
    on_grid = torch.tensor([7.0, -3.0, 2.0, 0.0, 1.0, -7.0])  # scale 1: exact
    assert torch.equal(decode(encode(on_grid, "fp4-uniform"), 6, "fp4-uniform"), on_grid)


def test_a_bare_codec_says_it_has_no_family():
    bare = codecs.Codec("fp8", 1.0, True, "a new dense codec")
    assert bare.payload_bytes(100, 64) == 100 + 2 * 2  # the dense count holds without a family
    with pytest.raises(NotImplementedError, match="Raw, Blocks or TopK"):
        bare.encode(torch.ones(3))
