"""The Triton codecs (comm/codecs_triton.py, lowband's codec on CUDA) against the eager codec,
bitwise, on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set before Triton is
imported, hence the subprocess). On a GPU benchmarks/gpu_codecs.py checks the compiled kernels
the same way; this test holds the arithmetic to the eager definition where no GPU is lent."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECK = r'''
import torch
from lowband.comm import codecs as C, codecs_triton as T

def values(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(3 * torch.randn(n, generator=g))
    tail = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3e38, 7e-20, 0.5])[:n]
    x[n - len(tail):] = tail
    return x

for codec in ("int8", "fp4-e3m0", "fp4-e2m1"):
    for block in (64, 32, 2):
        for i, n in enumerate((1, 2, 63, 64, 65, 1001, 0)):
            x = values(n, i)
            if codec != "int8" and n >= block:  # exact ties between two levels, then past them
                mids = torch.tensor(C._mids(codec))
                x[: 2 * len(mids)] = torch.cat([mids, torch.nextafter(mids, mids + 1)])[: n]
                x[block - 1] = C._TOP[codec]  # the first block's scale is exactly 1
            size = C.payload_bytes(codec, n, block)
            want = C.encode(x, codec, block, compiled=False)
            got, finite = T.encode(x, size, block, C._TOP[codec], C._CAP[codec], C._mids(codec),
                                   tiles={"ROWS": 4})
            assert bool(finite) and torch.equal(got, want), (codec, block, n)
            table = None
            if codec != "int8":
                lv = C._LEVELS[codec]
                table = torch.tensor(lv + tuple(-v for v in lv))
            y = T.decode(want, n, block, table, tiles={"SPAN": 128})
            ref = C.decode(want, n, codec, block, compiled=False)
            assert torch.equal(y.view(torch.int32), ref.view(torch.int32)), (codec, block, n)
x = torch.tensor([1.0, float("nan"), 2.0, float("inf")])
assert not bool(T.encode(x, C.payload_bytes("int8", 4, 64), 64, 127.0, C._CAP["int8"], (),
                         tiles={"ROWS": 4})[1])
print("ok")
'''


def test_triton_codecs_equal_eager_bitwise_in_the_interpreter():
    pytest.importorskip("triton", reason="Triton is installed with the dev extra")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[1] / "toolkit"))
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
