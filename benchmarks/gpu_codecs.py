"""Codec throughput on one device: int8 and fp4 encode+decode, eager and compiled, against the
device's copy bandwidth.

Bytes moved by one encode+decode of n fp32 values whose payload is P bytes: encode reads 4n and
writes P, decode reads P and writes 4n, so 8n + 2P; GB/s is that over the encode time plus the
decode time (medians). The reference is `dst.copy_(src)` of n fp32 values, 8n bytes read and
written. Each row also has the largest error, whether the compiled codec's payload and values
are bitwise the eager ones, and whether the device's are bitwise those of the codec on the CPU
(from a copy of the same input). The GPU goal: compiled >= 70% of copy, bitwise equal to both.
CUDA times come from CUDA events, CPU times from perf_counter; encode includes its host sync
(the NaN/inf check).

    PYTHONPATH=toolkit python benchmarks/gpu_codecs.py [--device cuda] [--numel N] [--repeats R]

`benchmarks/gpu.py` imports `codec_throughput` (run from benchmarks/, as every benchmark here).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from lowband.comm import decode, encode, payload_bytes


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


def codec_throughput(device, numel: int, codecs=("int8", "fp4-e3m0", "fp4-e2m1"), block: int = 64,
                     repeats: int | None = None) -> list[dict]:
    """One row per codec and mode (eager, compiled); see the module docstring for the fields."""
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
        cpu_payload = encode(x_cpu, codec, block)
        cpu_y = decode(cpu_payload, numel, codec, block)
        eager = None
        for mode in ("eager", "compiled"):
            c = mode == "compiled"
            run = functools.partial(encode, x, codec, block, compiled=c)
            payload, enc_s = _median_time(device, run, repeats)
            run = functools.partial(decode, payload, numel, codec, block, compiled=c)
            y, dec_s = _median_time(device, run, repeats)
            eager = eager or (payload, y)
            gbs = (8 * numel + 2 * size) / (enc_s + dec_s) / 1e9
            rows.append({
                "codec": codec, "mode": mode, "numel": numel, "block": block,
                "payload_bytes": size, "encode_ms": 1e3 * enc_s, "decode_ms": 1e3 * dec_s,
                "gbs": gbs, "copy_gbs": copy_gbs, "of_copy": gbs / copy_gbs,
                "max_abs_err": float((y - x).abs().max()) if numel else 0.0,
                "equals_eager": bool(torch.equal(payload, eager[0])
                                     and torch.equal(_bits(y), _bits(eager[1]))),
                "equals_cpu": bool(torch.equal(payload.cpu(), cpu_payload)
                                   and torch.equal(_bits(y.cpu()), _bits(cpu_y))),
                # where the device's bytes differ from the CPU's: scale bytes, code bytes
                "differ_cpu": [int((payload.cpu() != cpu_payload)[: 2 * -(-numel // block)].sum()),
                               int((payload.cpu() != cpu_payload)[2 * -(-numel // block):].sum())],
            })
            del payload, y
        del eager, cpu_payload, cpu_y
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
    rows = codec_throughput(device, numel, block=a.block, repeats=a.repeats)
    print(f"{name}, torch {torch.__version__}: {numel:,} fp32 values, block {a.block}, "
          f"copy_ {rows[0]['copy_gbs']:.1f} GB/s (bytes read + written)")
    print(f"{'codec':<10}{'mode':<10}{'enc ms':>9}{'dec ms':>9}{'GB/s':>8}{'of copy':>9}"
          f"{'max err':>10}{'=eager':>8}{'=cpu':>6}")
    for r in rows:
        print(f"{r['codec']:<10}{r['mode']:<10}{r['encode_ms']:>9.2f}{r['decode_ms']:>9.2f}"
              f"{r['gbs']:>8.2f}{100 * r['of_copy']:>8.1f}%{r['max_abs_err']:>10.3g}"
              f"{r['equals_eager']!s:>8}{r['equals_cpu']!s:>6}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
