"""`lowband plan`: a table for people, --json for scripts; bad input exits 2 with one sentence."""

from __future__ import annotations

import argparse
import json
import os
import sys

from lowband.comm.codecs import CHUNK, DENSITY
from lowband.config import ArgParser
from lowband.models import names
from lowband.plan.api import plan
from lowband.plan.inputs import BLOCK_SIZE, CODECS, fmt_bandwidth, fmt_bytes, fmt_count, fmt_seconds

EXAMPLE = ("lowband plan --params 1e9 --layers 24 --step-time 0.1 --replicas 2 --sync-every 100 "
           "--fragments 8 --overlap 1 --codec fp4-e3m0 --bandwidth 1gbit --target-cu 0.9")


def table(result: dict) -> str:
    """The human table of a plan() result."""
    i, target = result["inputs"], result["target_cu"]
    link = {None: "(no --bandwidth: CU not shown)", "inf": "unlimited"}.get(i["bandwidth"])
    link = link or fmt_bandwidth(i["bandwidth"])
    lines = [
        f"{fmt_count(i['params'])} params, {i['layers']} blocks, "
        f"step {fmt_seconds(i['step_time'])}, {i['replicas']} replicas, "
        f"H={i['sync_every']} P={i['fragments']} tau={i['overlap']}"
        f"{_fragments(i['fragment_sizes'])}",
        f"outer codec {i['codec']} ({i['codec_bytes_per_value']:.4g} B/value), exchange "
        f"{i['exchange']}, "
        f"ddp/acco send {i['grad_dtype']}; link {link}, latency {fmt_seconds(i['latency'])}",
        ""]
    rows = [("algorithm", "CU", "stall/step", "wire/step", "largest transfer",
             f"needs for CU {target:g}")]
    for alg, r in result["algorithms"].items():
        rows.append((alg, "-" if r["cu"] is None else f"{r['cu']:.3f}",
                     fmt_seconds(r["stall_per_step"]), fmt_bytes(r["wire_bytes_per_step"]),
                     fmt_bytes(r["peak_transfer_bytes"]), fmt_bandwidth(r["required_bandwidth"])))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def _fragments(sizes) -> str:
    """', largest fragment 73.9k values (33%)': of the real split, for P > 1."""
    if len(sizes) == 1:
        return ""
    return f", largest fragment {fmt_count(max(sizes))} values ({max(sizes) / sum(sizes):.0%})"


def _parser() -> argparse.ArgumentParser:
    # every value is read as text and validated by make_run, so that errors read the same
    p = ArgParser(prog="lowband plan", epilog=f"example: {EXAMPLE}",
                description="How much bandwidth does a run need? Simulates the schedule of ddp, "
                "diloco, streaming and acco on one slow link (docs/plan.md).")
    add = p.add_argument
    add("--params", help="parameter count, e.g. 1e9 or 1.3B")
    add("--layers", help="number of blocks (with a preset --model: its n_layer, as lowband "
        "train's --n-layer)")
    add("--model", help=f"a model instead of --params/--layers: {names()}; built on the meta "
        "device for its parameter count and real fragments")
    add("--step-time", help="compute seconds per step, e.g. 0.1 or 100ms")
    add("--flops-per-step", help="FLOPs of one step (with --flops, instead of --step-time)")
    add("--flops", help="achieved FLOP/s of one replica")
    add("--replicas", default="2", help="R: replicas joined by the slow link (default 2)")
    add("--sync-every", default="100", help="H: inner steps between syncs (default 100)")
    add("--fragments", default="1", help="P: streaming fragments (default 1)")
    add("--overlap", default="0", help="tau: steps a streaming sync overlaps (default 0)")
    add("--codec", default="fp32", help=f"outer exchange: {', '.join(CODECS)} (default fp32)")
    add("--grad-dtype", default="bf16", help="what ddp and acco send: fp32, bf16, fp16 (bf16)")
    add("--bandwidth", help="link bits/s: 1e9, 100mbit, 1gbit, 10gbit, 10Gbps or inf")
    add("--latency", default="0", help="seconds per transfer, e.g. 0.05 or 50ms (default 0)")
    add("--steps", help="simulate a whole run of this many steps (default: the steady state)")
    add("--target-cu", default="0.9", help="compute utilization to reach (default 0.9)")
    add("--block-size", default=str(BLOCK_SIZE), help="values per quantization scale (64)")
    add("--exchange", default="auto", help="how a quantized average travels: all-gather, "
        "two-phase or auto (the fewer bytes, as lowband train's --exchange; default auto)")
    add("--density", default=str(DENSITY), help="topk codecs: the share of each chunk's values "
        f"sent (default {DENSITY})")
    add("--sparse-chunk", default=str(CHUNK), help=f"topk codecs: values a chunk (default {CHUNK})")
    add("--fragment-pattern", default="strided", help="strided (block i -> fragment i mod P) or "
        "sequential, as lowband train's (default strided)")
    add("--bucket-mb", help="ddp buckets of this many MiB of fp32 grads (default: one per block)")
    add("--acco-rounds", default="2", help="acco communication rounds per step (default 2)")
    add("--json", action="store_true", help="print JSON for scripts instead of a table")
    return p


def main(argv: list[str] | None = None) -> int:
    """`lowband plan ...`: 0 on success, 2 on bad input (one sentence on stderr)."""
    try:
        a = _parser().parse_args(argv)
        kw = {k: v for k, v in vars(a).items() if k not in ("json", "target_cu") and v is not None}
        result = plan(a.target_cu, **kw)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except ValueError as e:
        print(f"lowband plan: {e}", file=sys.stderr)
        return 2
    i = result["inputs"]
    if i["sync_every"] % i["fragments"]:
        print(f"lowband plan: note: {i['fragments']} fragments do not divide H={i['sync_every']}, "
              "so fragment syncs are spaced unevenly (lowband train needs H divisible by P).",
              file=sys.stderr)
    try:
        print(json.dumps(result, indent=2) if a.json else table(result), flush=True)
    except BrokenPipeError:  # `lowband plan ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
