"""Codec throughput on one device: int8 and fp4 encode+decode, eager and compiled, against the
device's copy bandwidth; on CUDA also each fp4 encode variant of the Triton kernels; and the
sparse (topk) codecs' encode and decode.

Bytes moved by one encode+decode of n fp32 values whose payload is P bytes: encode reads 4n and
writes P, decode reads P and writes 4n, so 8n + 2P; GB/s is that over the encode time plus the
decode time (medians); encode_gbs and decode_gbs are each half of it over its own time. The
reference is `dst.copy_(src)` of n fp32 values, 8n bytes read and written. Each row also has
the largest error, whether the compiled codec's payload and values are bitwise the eager ones,
whether the device's are bitwise those of the codec on the CPU (from a copy of the same input),
equals_cpu_edges: the same on edge_values() (rounding boundaries, zeros, subnormal and huge
scales, an odd tail), and wall_s: the seconds the row took (compiles and checks included). The
GPU goal: compiled >= 70% of copy, bitwise equal to both. CUDA times come from CUDA events, CPU
times from perf_counter; encode includes its host sync (the NaN/inf check).

Rows with mode "triton:<variant>" (CUDA only) time one of codecs_triton.FP4_VARIANTS' encodes
(fewer repeats); their decode is the compiled row's (the same kernel on the same bytes); a
variant that fails has NaN times and its error. The topk rows (mode "eager", chunks of
sparse.CHUNK values, density sparse.DENSITY) are compared with the CPU on the first
`checked_numel` values (sorting 2^28 values on the CPU takes long).

    PYTHONPATH=toolkit python benchmarks/gpu_codecs.py [--device cuda] [--numel N] [--repeats R]

`benchmarks/gpu.py` imports `codec_throughput` (run from benchmarks/, as every benchmark here).
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import time

import torch

from lowband.comm import codecs as C
from lowband.comm import decode, encode, payload_bytes
from lowband.comm.sparse import Chunks

SPARSE_CHECKED = 2 ** 22  # topk values compared with the CPU


def _timed(device: torch.device, fn):
    """(fn(), seconds it took on the device)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return out, start.elapsed_time(end) / 1e3
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def _median_time(device: torch.device, fn, repeats: int) -> tuple[object, float]:
    fn()  # warm-up (and, for the compiled codec, the compile)
    runs = [_timed(device, fn) for _ in range(repeats)]
    return runs[-1][0], statistics.median(t for _, t in runs)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def edge_values(codec: str, block: int, seed: int = 0) -> torch.Tensor:
    """fp32 values (CPU) that corner a quantized codec's rounding: for scales s from the
    smallest bf16 (subnormal) to the cap, blocks holding top * s (so that the block's scale is
    exactly s) and the rounding boundaries times s (fp4: subnormal for the small scales), each
    also one ulp up and down, with zeros and the smallest subnormal, signs and places at random;
    blocks of +0.0, of -0.0, of subnormals, of huge values, of huge and tiny ones together; then
    a short block of odd length (n is odd)."""
    g = torch.Generator().manual_seed(seed)
    grid = C.CODEC_RECORDS[codec].grid
    top = grid.top
    bounds = grid.mids or (0.5, 1.5, 2.5, 63.5, 126.5)  # int8: ties of the rounding
    scales = (1.0, 0.1875, 1.9921875 * 2.0 ** 20, 2.0 ** -118, 1.5 * 2.0 ** -119, 2.0 ** -126,
              1.25 * 2.0 ** -130, 2.0 ** -133, 1.0078125 * 2.0 ** 100, grid.cap)
    inf = torch.tensor(math.inf)

    def blocks(s: float, length: int) -> list[torch.Tensor]:
        at = torch.tensor([b * s for b in bounds], dtype=torch.float64).float()
        probes = torch.cat([at, torch.nextafter(at, inf), torch.nextafter(at, -inf),
                            torch.tensor([0.0, -0.0, 2.0 ** -149])])
        probes = probes[torch.randperm(len(probes), generator=g)]
        out = []
        for part in probes.split(length - 1):
            b = torch.cat([torch.tensor([top * s]), part, torch.zeros(length - 1 - len(part))])
            sign = torch.where(torch.rand(length, generator=g) < 0.5, -1.0, 1.0)
            out.append((b * sign)[torch.randperm(length, generator=g)])
        return out

    rnd = functools.partial(torch.rand, block, generator=g)
    big = torch.tensor([torch.finfo(torch.float32).max, -3.4e38, -2.0 ** -149, 3e38, -0.0])
    parts = [b for s in scales for b in blocks(s, block)] + [
        torch.zeros(block), -torch.zeros(block), (rnd() - 0.5) * 2e-38,  # subnormals
        (2 * rnd() - 1) * 3.4e38, torch.cat([big, torch.zeros(block)])[:block]]
    tail = (block // 2) | 1
    parts += [b[:tail] for b in blocks(1.0, block)[:1]]
    return torch.cat(parts)


def _edges_equal(codec: str, block: int, device, encode_fn) -> bool:
    """Whether encode_fn(x on device) is bitwise the CPU codec's bytes on edge_values()."""
    x = edge_values(codec, block)
    return bool(torch.equal(encode_fn(x.to(device)).cpu(), encode(x, codec, block)))


def _row(codec, mode, numel, block, size, enc_s, dec_s, copy_gbs, **fields) -> dict:
    moved = 4 * numel + size  # each way
    gbs = 2 * moved / (enc_s + dec_s) / 1e9
    return {"codec": codec, "mode": mode, "numel": numel, "block": block, "payload_bytes": size,
            "encode_ms": 1e3 * enc_s, "decode_ms": 1e3 * dec_s, "gbs": gbs,
            "copy_gbs": copy_gbs, "of_copy": gbs / copy_gbs, "encode_bytes": moved,
            "decode_bytes": moved, "encode_gbs": moved / enc_s / 1e9,
            "decode_gbs": moved / dec_s / 1e9, **fields}


def _differ(payload: torch.Tensor, ref: torch.Tensor, scale_bytes: int) -> list[int]:
    """Bytes where the device's payload differs from the CPU's: [scale bytes, code bytes]."""
    ne = payload != ref
    return [int(ne[:scale_bytes].sum()), int(ne[scale_bytes:].sum())]


def _variants(device, x, codec, block, size, cpu_ref, eager, compiled, repeats, copy_gbs):
    """Rows of the fp4 encode variants (codecs_triton.FP4_VARIANTS), timed on CUDA."""
    from lowband.comm import codecs_triton as T

    grid = C.CODEC_RECORDS[codec].grid
    args = (block, grid.top, grid.cap, grid.mids)
    rows = []
    for name, tiles in T.FP4_VARIANTS.items():
        wall = time.perf_counter()

        def run(v, tiles=tiles):
            payload, finite = T.encode(v, payload_bytes(codec, v.numel(), block), *args, tiles)
            assert bool(finite)  # the host sync the codec's encode has
            return payload
        try:
            payload, enc_s = _median_time(device, functools.partial(run, x), repeats)
            equal = bool(torch.equal(payload, cpu_ref))
            rows.append(_row(
                codec, f"triton:{name}", x.numel(), block, size, enc_s,
                compiled["decode_ms"] / 1e3, copy_gbs,
                max_abs_err=compiled["max_abs_err"] if equal else math.nan,
                equals_eager=bool(torch.equal(payload, eager)), equals_cpu=equal,
                differ_cpu=_differ(payload, cpu_ref, 2 * -(-x.numel() // block)),
                equals_cpu_edges=_edges_equal(codec, block, device, run)))
            rows[-1]["wall_s"] = time.perf_counter() - wall
            del payload
        except Exception as e:  # noqa: BLE001 -- a variant that fails is reported, not fatal
            rows.append(_row(codec, f"triton:{name}", x.numel(), block, size, math.nan, math.nan,
                             copy_gbs, max_abs_err=math.nan, equals_eager=False,
                             equals_cpu=False, differ_cpu=[-1, -1], equals_cpu_edges=False,
                             error=f"{type(e).__name__}: {e}"[:500],
                             wall_s=time.perf_counter() - wall))
    return rows


def _sparse(device, x, x_cpu, codec, repeats, copy_gbs) -> dict:
    """A topk codec's row: encode and decode timed on the device, compared with the CPU on the
    first SPARSE_CHECKED values."""
    chunks, numel, wall = Chunks(), x.numel(), time.perf_counter()
    size = payload_bytes(codec, numel, chunks)
    payload, enc_s = _median_time(device, functools.partial(encode, x, codec, chunks), repeats)
    y, dec_s = _median_time(device, functools.partial(decode, payload, numel, codec, chunks),
                            repeats)
    err = float((y - x).abs().max()) if numel else 0.0
    del payload, y
    m = min(numel, SPARSE_CHECKED)
    head = encode(x[:m], codec, chunks)
    ref = encode(x_cpu[:m], codec, chunks)
    same = bool(torch.equal(head.cpu(), ref) and torch.equal(
        _bits(decode(head, m, codec, chunks).cpu()), _bits(decode(ref, m, codec, chunks))))
    scale_bytes = 2 * C.CODEC_RECORDS[codec].scales * -(-m // chunks.size)
    return _row(codec, "eager", numel, chunks.size, size, enc_s, dec_s, copy_gbs,
                density=chunks.density, max_abs_err=err, equals_eager=True, equals_cpu=same,
                differ_cpu=_differ(head.cpu(), ref, scale_bytes) if len(head) == len(ref)
                else [-1, -1], checked_numel=m, wall_s=time.perf_counter() - wall)


def codec_throughput(device, numel: int, codecs=("int8", "fp4-e3m0", "fp4-e2m1"), block: int = 64,
                     repeats: int | None = None, sparse=("topk-2bit", "topk-fp4"),
                     variants: bool = True) -> list[dict]:
    """One row per codec and mode (eager, compiled; on CUDA triton:<variant> for fp4), then
    one per sparse codec; see the module docstring for the fields."""
    device = torch.device(device)
    repeats = repeats or (20 if device.type == "cuda" else 3)
    g = torch.Generator(device).manual_seed(0)
    # values spanning orders of magnitude, as pseudo-gradients do
    x = torch.randn(numel, device=device, generator=g) * torch.exp(
        2 * torch.randn(numel, device=device, generator=g))
    _, copy_s = _median_time(device, functools.partial(torch.empty_like(x).copy_, x), repeats)
    copy_gbs = 8 * numel / copy_s / 1e9
    x_cpu = x.cpu()
    rows = []
    for codec in codecs:
        size = payload_bytes(codec, numel, block)
        scale_bytes = 2 * -(-numel // block)
        cpu_payload = encode(x_cpu, codec, block)
        cpu_y = decode(cpu_payload, numel, codec, block)
        eager = None
        for mode in ("eager", "compiled"):
            c, wall = mode == "compiled", time.perf_counter()
            run = functools.partial(encode, x, codec, block, compiled=c)
            payload, enc_s = _median_time(device, run, repeats)
            run = functools.partial(decode, payload, numel, codec, block, compiled=c)
            y, dec_s = _median_time(device, run, repeats)
            eager = eager or (payload, y)
            rows.append(_row(
                codec, mode, numel, block, size, enc_s, dec_s, copy_gbs,
                max_abs_err=float((y - x).abs().max()) if numel else 0.0,
                equals_eager=bool(torch.equal(payload, eager[0])
                                  and torch.equal(_bits(y), _bits(eager[1]))),
                equals_cpu=bool(torch.equal(payload.cpu(), cpu_payload)
                                and torch.equal(_bits(y.cpu()), _bits(cpu_y))),
                # where the device's bytes differ from the CPU's: scale bytes, code bytes
                differ_cpu=_differ(payload.cpu(), cpu_payload, scale_bytes),
                equals_cpu_edges=_edges_equal(
                    codec, block, device, lambda v, c=c: encode(v, codec, block, compiled=c)),
                wall_s=time.perf_counter() - wall))
            del payload, y
        if variants and device.type == "cuda" and C.CODEC_RECORDS[codec].grid.levels:  # fp4
            from lowband.comm import codecs_triton as T

            if T.usable(block):
                rows += _variants(device, x, codec, block, size, cpu_payload.to(device),
                                  eager[0], rows[-1], max(3, repeats // 4), copy_gbs)
        del eager, cpu_payload, cpu_y
    for codec in sparse:
        rows.append(_sparse(device, x, x_cpu, codec, max(3, repeats // 4), copy_gbs))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--numel", type=int, help="fp32 values (default 2**28, 1 GiB, on cuda; "
                                             "2**22 on cpu)")
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--repeats", type=int)
    a = p.parse_args(argv)
    device = torch.device(a.device)
    numel = a.numel or (2 ** 28 if device.type == "cuda" else 2 ** 22)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    t = time.perf_counter()
    rows = codec_throughput(device, numel, block=a.block, repeats=a.repeats)
    print(f"{name}, torch {torch.__version__}: {numel:,} fp32 values, block {a.block}, "
          f"copy_ {rows[0]['copy_gbs']:.1f} GB/s (bytes read + written); "
          f"{time.perf_counter() - t:.1f} s in all")
    print(f"{'codec':<10}{'mode':<18}{'enc ms':>9}{'dec ms':>9}{'enc GB/s':>9}{'GB/s':>8}"
          f"{'of copy':>9}{'max err':>10}{'=eager':>8}{'=cpu':>6}{'=edges':>8}")
    for r in rows:
        print(f"{r['codec']:<10}{r['mode']:<18}{r['encode_ms']:>9.3f}{r['decode_ms']:>9.3f}"
              f"{r['encode_gbs']:>9.1f}{r['gbs']:>8.1f}{100 * r['of_copy']:>8.1f}%"
              f"{r['max_abs_err']:>10.3g}{r['equals_eager']!s:>8}{r['equals_cpu']!s:>6}"
              f"{r.get('equals_cpu_edges', '-')!s:>8}  {r.get('error', '')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
