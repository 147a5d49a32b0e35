"""The Triton codecs (comm/codecs_triton.py, lowband's codec on CUDA) against the eager codec,
bitwise, on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set before Triton is
imported, hence the subprocess): every fp4 encode variant the GPU benchmark times, on values
that corner the rounding (benchmarks/gpu_codecs.py's edge_values) and on random ones. On a GPU
benchmarks/gpu_codecs.py checks the compiled kernels the same way; this test holds the
arithmetic to the eager definition where no GPU is lent. The step the products rest on (from
the division to a comparison of bits) is checked for every bf16 scale, without Triton."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowband.comm import codecs as C

ROOT = Path(__file__).resolve().parents[1]

CHECK = r'''
import math
import os
import torch
from lowband.comm import codecs as C, codecs_triton as T
from gpu_codecs import edge_values

DEV = os.environ.get("CHECK_DEVICE", "cpu")  # cuda: the compiled kernels on a GPU


def values(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(3 * torch.randn(n, generator=g))
    tail = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3e38, 7e-20, 0.5])[:n]
    x[n - len(tail):] = tail
    return x

# every fp4 variant, and the new kernel's with one block a program where a block is long (many
# programs: the last one's lone odd value); int8 with 4 blocks a program
for codec in ("int8", "fp4-e3m0", "fp4-e2m1"):
    grid = C.CODEC_RECORDS[codec].grid
    top, cap, mids = grid.top, grid.cap, grid.mids
    for block in (64, 32, 2):
        tiles = dict(T.FP4_VARIANTS) if mids else {"rows4": {"ROWS": 4}}
        for name in ("pairs", "strided", "pairs-div") if mids and block > 2 else ():
            tiles[name + "-rows1"] = {**T.FP4_VARIANTS[name], "ROWS": 1}
        if DEV == "cuda" and mids:  # every variant is a compile there (an H200 took > 150 s
            # for all): encode()'s own and one program a block; the benchmark's codecs section
            # checks every variant against the CPU codec on the device
            tiles = {k: v for k, v in tiles.items() if k in (T.FP4_ENCODE, "pairs-rows1")}
        inputs = [edge_values(codec, block, seed=block)] + [values(n, i) for i, n in
                                                            enumerate((1, 2, 63, 65, 1001, 0))]
        if mids:  # exact ties between two levels, then past them (the first block's scale is 1)
            x = values(block + 3, 7)
            m = torch.tensor(mids)
            x[: 2 * len(mids)] = torch.cat([m, torch.nextafter(m, m + 1)])[: block + 3]
            x[block - 1] = top
            inputs.append(x)
        inputs.append(torch.cat([torch.zeros(1), inputs[0]])[1:])  # 4 bytes off 8-byte alignment
        for x in inputs:
            n = x.numel()
            size = C.payload_bytes(codec, n, block)
            want = C.encode(x, codec, block, compiled=False)
            for name, t in tiles.items():
                got, finite = T.encode(x.to(DEV), size, block, top, cap, mids, tiles=t)
                assert bool(finite) and torch.equal(got.cpu(), want), (codec, block, n, name,
                                                                 (got != want).nonzero()[:4])
            table = None
            if mids:
                lv = grid.levels
                table = torch.tensor(lv + tuple(-v for v in lv)).to(DEV)
            y = T.decode(want.to(DEV), n, block, table, tiles={"SPAN": 128}).cpu()
            ref = C.decode(want, n, codec, block, compiled=False)
            assert torch.equal(y.view(torch.int32), ref.view(torch.int32)), (codec, block, n)
        # NaN and inf are counted: first value, the last (odd n: alone in its pair), a middle one
        x = inputs[0]
        for name, t in tiles.items():
            for at, v in ((0, math.nan), (len(x) - 1, math.inf), (len(x) // 2, -math.inf)):
                bad = x.clone()
                bad[at] = v
                assert not bool(T.encode(bad.to(DEV), size, block, top, cap, mids, tiles=t)[1]), (
                    codec, block, name, at)
print("ok")
'''


def _check(**env) -> None:
    pytest.importorskip("triton", reason="Triton is installed with the test extra")
    env = dict(os.environ, **env,
               PYTHONPATH=os.pathsep.join([str(ROOT / "toolkit"), str(ROOT / "benchmarks")]))
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.slow
def test_triton_codecs_equal_eager_bitwise_in_the_interpreter():
    _check(TRITON_INTERPRET="1")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (a GPU session)")
def test_triton_codecs_on_the_gpu_equal_the_cpu_codec_bitwise():
    """The same checks with the kernels compiled for the GPU: the products' subnormal cases and
    the division's rounding on the hardware, not the interpreter's numpy."""
    _check(CHECK_DEVICE="cuda")


def test_products_decide_as_the_division_for_every_bf16_scale():
    """codecs_triton's fp4 step, for every positive bf16 scale s up to the cap (subnormal ones
    too): p = m s is exact and increasing in m, and the next fp32 number after p divided by s
    rounds above m while p / s does not; div_rn being monotone in the numerator, div_rn(a, s) > m
    iff a > p (iff bits(a) > bits(p)) for every fp32 a >= 0."""
    every = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    up = torch.tensor(math.inf)
    for codec in ("fp4-e3m0", "fp4-e2m1"):
        grid = C.CODEC_RECORDS[codec].grid
        s = every[every <= grid.cap]
        last = torch.zeros_like(s)
        for m in grid.mids:
            p = torch.tensor(m, dtype=torch.float32) * s
            assert torch.equal(p.double(), m * s.double()) and bool((p > last).all())
            assert bool((torch.nextafter(p, up) / s > m).all()) and not bool((p / s > m).any())
            last = p
