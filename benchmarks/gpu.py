"""The GPU path measured in one call, every figure side by side in the same process.

  inner     lowband's inner loop (the trainer, world 1) against a plain PyTorch loop written
            here, same model, batch, bf16 autocast, fused AdamW, eager and compiled: tokens/s,
            model FLOP utilization, ratio (goal >= 0.95)
  codecs    int8 and fp4 encode+decode against the device's copy bandwidth (goal >= 70%),
            bitwise agreement of compiled and eager, of the device and the CPU (gpu_codecs.py)
  overhead  streaming (P=4, fp4, tau=1), edit, acco, zero1 against ddp at the same batch, world 1,
            so only the bookkeeping is measured: extra time per token over H steps (goal <= 5%);
            streaming without its guard (the guard's cost), ddp and streaming with Muon
  e2e       several ranks on one GPU (gloo with CUDA tensors: NCCL refuses two ranks on one
            device): each algorithm end to end through `lowband train`; with CUDA tensors comm
            times come from CUDA events; reports how much outer-transfer time was hidden
            behind compute; streaming with one replica 2x slower, fixed against speed-aware
            local steps (--e2e "streaming slow,streaming slow adaptive")

    PYTHONPATH=toolkit python3 benchmarks/gpu.py                # a CUDA machine: GPT-2 124M
    python benchmarks/gpu.py --smoke                            # anywhere: tiny sizes, checks
    python benchmarks/gpu.py --sections inner,codecs --json out.json --keep-runs runs/
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from lowband.config import Config
from lowband.data import Batches, load_tokens
from lowband.launch.local import free_port
from lowband.models import compile_blocks, num_params
from lowband.models.gpt import GPT, gpt_config
from lowband.telemetry import read_events

SECTIONS = ("inner", "codecs", "overhead", "target", "e2e")
# dense bf16 tensor-core peaks from the vendors' data sheets (SXM parts), FLOP/s
SPEC_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from machine import describe  # benchmarks/machine.py

    return describe()


def matmul_peak(device: torch.device, n: int, repeats: int = 10) -> float:
    """Measured FLOP/s of an n x n x n product (bf16 on CUDA, fp32 on CPU)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync(device)
    return 2 * n ** 3 * repeats / (time.perf_counter() - t0)


def flops_per_token(model: GPT, seq_len: int) -> float:
    """6 N (forward and backward of the weights, position table left out) plus attention's
    12 L d T (the estimate of the PaLM paper's appendix, as nanoGPT uses it)."""
    c = model.config
    n = num_params(model) - model.wpe.weight.numel()
    return 6 * n + 12 * c.n_layer * c.d_model * seq_len


# ---------------------------------------------------------------- a plain PyTorch loop


def plain_loop(cfg: Config, device: torch.device, compiled: str) -> list[float]:
    """The loop a user writes without lowband: same model, data, autocast and fused AdamW.
    compiled: '' (eager), 'model' (torch.compile(model)) or 'blocks' (as lowband compiles).
    Returns the host time at the end of each step (after the loss reached the host)."""
    torch.manual_seed(cfg.seed)
    model = GPT(gpt_config(cfg.model, seq_len=cfg.seq_len)).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg.lr,
                            betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda")
    run = model
    if compiled == "model":
        run = torch.compile(model)
    elif compiled == "blocks":
        compile_blocks(model.blocks)
    data = Batches(load_tokens(cfg.data), rank=0, world=1, seq_len=cfg.seq_len,
                   batch_size=cfg.batch_size, seed=cfg.seed, val_fraction=cfg.val_fraction,
                   device=device)
    ends = []
    for step in range(cfg.steps):
        for micro in range(cfg.grad_accum):
            x, y = data.train(step, micro)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16"):
                logits = run(x)
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            (loss / cfg.grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        ends.append(time.perf_counter())
    return ends


# ---------------------------------------------------------------- lowband's trainer, world 1


def lowband_run(cfg: Config, root: Path) -> tuple[list[float], list[int]]:
    """lowband.train.train in this process as a world of one. Returns (time at each step's
    event, cumulative tokens at it)."""
    from lowband.train import train

    cfg.run_dir = str(root / f"{cfg.algo}-{len(list(root.iterdir()))}")
    train(cfg)
    steps = sorted((e["step"], e["t"], e["tokens"]) for e in read_events(cfg.run_dir, ("step",)))
    return [t for _, t, _ in steps], [tok for _, _, tok in steps]


def per_step(ends: list[float], warm: int) -> float:
    """Seconds per step over the steps after the warm-up ones (compilation, allocator)."""
    return (ends[-1] - ends[warm - 1]) / (len(ends) - warm)


def base_config(args, device: torch.device, **over) -> Config:
    c = Config(algo="ddp", link_bandwidth="", link_latency="0ms", model=args.model,
               seq_len=args.seq_len, batch_size=args.batch_size,
               steps=args.warm + args.steps, replicas=1, shards=1, device=device.type,
               precision=args.precision, eval_every=0, eval_batches=1, progress=False,
               warmup_steps=2, lr=1e-3)
    for k, v in over.items():
        setattr(c, k, v)
    return c


def section_inner(args, device, root) -> list[dict]:
    probe = GPT(gpt_config(args.model, seq_len=args.seq_len))
    fpt = flops_per_token(probe, args.seq_len)
    measured = matmul_peak(device, 8192 if device.type == "cuda" else 512)
    spec = next((v for k, v in SPEC_BF16.items() if k in device_name(device)), None)
    tokens = args.batch_size * args.seq_len
    rows = []
    for compiled in args.compile_modes:
        cfg = base_config(args, device, compile=compiled != "")
        loops = {"plain": lambda: plain_loop(cfg, device, "model" if compiled else ""),
                 "lowband": lambda: lowband_run(base_config(args, device, compile=compiled != ""),
                                                root)[0]}
        if compiled:
            loops["plain-blocks"] = lambda: plain_loop(cfg, device, "blocks")
        times = {name: [] for name in loops}
        for rep in range(args.repeats):  # each repeat starts with the next loop: clock drift
            order = list(loops)          # (the GPU warming up) hits every loop alike
            for name in order[rep % len(order):] + order[: rep % len(order)]:
                times[name].append(per_step(loops[name](), args.warm))
        for name, ts in times.items():
            s = statistics.median(ts)
            rows.append({"loop": name, "compile": bool(compiled), "step_ms": 1e3 * s,
                         "tokens_per_s": tokens / s, "mfu_spec": tokens / s * fpt / spec if spec else None,
                         "mfu_measured_peak": tokens / s * fpt / measured,
                         "ratio_to_plain": statistics.median(times["plain"]) / s})
    print(f"\n[inner] {args.model} ({num_params(probe) / 1e6:.1f}M), batch {args.batch_size}x"
          f"{args.seq_len}, {args.precision}, {args.steps} timed steps after {args.warm}; "
          f"{fpt / 1e6:.0f} MFLOP/token; matmul peak measured {measured / 1e12:.1f} TFLOP/s"
          + (f", spec {spec / 1e12:.0f}" if spec else ""))
    print(f"  {'loop':<13}{'compile':>8}{'ms/step':>10}{'tokens/s':>12}{'MFU spec':>10}"
          f"{'MFU meas.':>10}{'vs plain':>10}")
    for r in rows:
        mfu = f"{100 * r['mfu_spec']:.1f}%" if r["mfu_spec"] else "-"
        print(f"  {r['loop']:<13}{str(r['compile']):>8}{r['step_ms']:>10.2f}{r['tokens_per_s']:>12,.0f}"
              f"{mfu:>10}{100 * r['mfu_measured_peak']:>9.1f}%{r['ratio_to_plain']:>10.3f}")
    return rows


def section_codecs(args, device, root) -> list[dict]:
    from gpu_codecs import codec_throughput  # benchmarks/gpu_codecs.py

    rows = codec_throughput(device, args.codec_numel)
    print(f"\n[codecs] {args.codec_numel:,} fp32 values, block 64; copy_ moves "
          f"{rows[0]['copy_gbs']:.1f} GB/s read+written (goal: encode+decode >= 70% of it)")
    print(f"  {'codec':<10}{'mode':<20}{'enc ms':>9}{'dec ms':>9}{'GB/s':>9}{'of copy':>9}"
          f"{'max err':>10}  =eager =cpu")
    for r in rows:
        print(f"  {r['codec']:<10}{r['mode']:<20}{r['encode_ms']:>9.3f}{r['decode_ms']:>9.3f}"
              f"{r['gbs']:>9.1f}{100 * r['of_copy']:>8.1f}%{r['max_abs_err']:>10.3g}  "
              f"{str(r['equals_eager']):<6} {r['equals_cpu']}"
              + ("" if r["equals_cpu"] else f" (bytes differing: {r['differ_cpu'][0]} scale, "
                                            f"{r['differ_cpu'][1]} code)"))
    return rows


STREAMING = {"algo": "streaming", "fragments": 4, "codec": "fp4-e3m0", "overlap": 1}
OVERHEAD_ALGOS = {
    "ddp": {},
    "streaming": STREAMING,
    "streaming, outer on cpu": {**STREAMING, "outer_state_device": "cpu"},
    "edit": {"algo": "edit"},
    "acco": {"algo": "acco", "acco_micro": "1:1"},
    "zero1": {"algo": "zero1"},
    # the guard on the outer step is streaming's default: its cost is streaming against this row
    "streaming guard off": {**STREAMING, "guard": "off"},
    # Muon as the inner optimizer (issue 46): its cost against AdamW, on ddp and on streaming
    "ddp muon": {"optimizer": "muon"},
    "streaming muon": {**STREAMING, "optimizer": "muon"},
    # the guard's pair again, in the other order (ABBA): its cost is the mean of the two pairs
    "streaming guard off again": {**STREAMING, "guard": "off"},
    "streaming again": STREAMING,
    "ddp again": {},
}
GUARD_PAIRS = (("streaming", "streaming guard off"),
               ("streaming again", "streaming guard off again"))


def section_overhead(args, device, root) -> list[dict]:
    rows = []
    n_blocks = gpt_config(args.model).n_layer
    for name, over in OVERHEAD_ALGOS.items():
        if args.overhead and name not in args.overhead:
            continue
        over = dict(over, sync_every=args.sync_every, compile="compile" in args.compile_modes)
        if "fragments" in over:
            over["fragments"] = min(over["fragments"], n_blocks)
        if name == "acco":  # acco's two groups of one micro-batch make one update of ddp's batch
            over["grad_accum"] = 1
        cfg = base_config(args, device, **over)
        try:
            ends, tokens = lowband_run(cfg, root)
        except Exception as e:  # noqa: BLE001 - a failing algorithm is a row of the table
            rows.append({"algo": name, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        tok_s = (tokens[-1] - tokens[args.warm - 1]) / (ends[-1] - ends[args.warm - 1])
        rows.append({"algo": name, "tokens_per_s": tok_s})
    # the baseline: the mean of ddp's first and last run (their spread is the run's noise)
    ddp = [r["tokens_per_s"] for r in rows
           if r["algo"] in ("ddp", "ddp again") and "error" not in r]
    base = statistics.mean(ddp) if ddp else float("nan")
    for r in rows:
        if "error" not in r:
            r["extra_per_token"] = base / r["tokens_per_s"] - 1
    print(f"\n[overhead] world 1 (no transfer leaves the rank), H={args.sync_every}, "
          f"{args.steps} timed steps; extra time per token against the mean of the two ddp runs "
          f"(goal <= 5%)")
    for r in rows:
        print(f"  {r['algo']:<24}" + (f"error: {r['error']}" if "error" in r else
                                      f"{r['tokens_per_s']:>12,.0f} tokens/s  {100 * r['extra_per_token']:+6.2f}%"))
    speed = {r["algo"]: r["tokens_per_s"] for r in rows if "error" not in r}
    costs = [speed[off] / speed[on] - 1 for on, off in GUARD_PAIRS if on in speed and off in speed]
    if costs:
        print(f"  the guard's cost (streaming against --guard off, {len(costs)} pair(s), "
              f"alternating): {', '.join(f'{100 * c:+.2f}%' for c in costs)}; mean "
              f"{100 * statistics.mean(costs):+.2f}%")
    return rows


E2E_STREAMING = ["--algo", "streaming", "--fragments", "2", "--overlap", "1"]
E2E = {
    "ddp": ["--algo", "ddp"],  # named: lowband train's own default is streaming
    "diloco": ["--algo", "diloco"],
    "streaming": E2E_STREAMING,
    "zero1": ["--algo", "zero1"],
    "acco": ["--algo", "acco", "--acco-micro", "1:1"],
    # one shard a replica: with several shards on one GPU, FSDP2's collectives go through gloo
    # with CUDA tensors, which crashed (SIGSEGV) on an H100; edit refuses that set-up
    "edit": ["--algo", "edit"],
    "aedit": ["--algo", "aedit", "--sync-seconds", "0.5"],
    # replica 1 computes 2x slower: fixed local steps (the fast replica waits at each sync)
    # against speed-aware ones (it runs more steps instead); longer, for several syncs
    "streaming slow": [*E2E_STREAMING, "--straggler", "1:2", "--steps", "32"],
    "streaming slow adaptive": [*E2E_STREAMING, "--straggler", "1:2", "--steps", "32",
                                "--local-steps", "adaptive"],
}


def llama_dir(root: Path, big: bool) -> Path:
    """A Hugging Face Llama's config.json (no weights: the run initialises it from its seed) of
    about GPT-2 124M's size: 12 layers of width 768, SwiGLU 2048, tied embeddings, 50,304 rows."""
    from transformers import LlamaConfig

    shape = (dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=12, vocab_size=50304)
             if big else dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=4, vocab_size=256))
    out = root / "llama"
    LlamaConfig(max_position_embeddings=1024, tie_word_embeddings=True, **shape).save_pretrained(out)
    return out


def section_target(args, device, root) -> dict:
    """Time to target (gpu_target.py): the compute of one replica's step is measured by the
    overhead section (ddp at a world of one, the same batch), doubled: two ranks share the GPU."""
    from gpu_target import run_all  # benchmarks/gpu_target.py

    ddp = next((r for r in args.results.get("overhead", ()) if r["algo"] == "ddp"
                and "error" not in r), None)
    if ddp is None and not args.ddp_tokens_per_s:
        raise SystemExit("the target section needs the overhead section's ddp row before it "
                         "(--sections overhead,target) or --ddp-tokens-per-s")
    tokens_per_s = ddp["tokens_per_s"] if ddp else args.ddp_tokens_per_s
    step_time = 2 * args.batch_size * args.seq_len / tokens_per_s
    common = {} if not args.smoke else {"model": args.model, "n_layer": 4, "seq_len": args.seq_len,
                                        "batch_size": args.batch_size, "eval_batches": 1}
    return run_all(args.target_data, step_time, args.target_seconds, "1gbit", device.type,
                   root, common)


def hidden_share(run: Path) -> tuple[float, int, int]:
    """(share of outer transfer time not spent waiting by the training thread, comm events,
    those timed by CUDA events)."""
    events = read_events(run, ("step", "comm"))
    comm = [e for e in events if e["kind"] == "comm" and e["group"] == "outer"]
    transfer = sum(e["end"] - e["start"] for e in comm)
    waited = sum(e["step_s"] - e["compute_s"] for e in events if e["kind"] == "step")
    cuda = sum(1 for e in events if e["kind"] == "comm" and e.get("clock") == "cuda")
    share = 1 - min(waited / transfer, 1.0) if transfer > 0 else float("nan")
    return share, len([e for e in events if e["kind"] == "comm"]), cuda


def section_e2e(args, device, root) -> list[dict]:
    model = args.e2e_model
    if model == "llama":
        model = f"hf:{llama_dir(root, not args.smoke)}"
    print(f"\n[e2e] {args.e2e_model} ({model}), data {args.e2e_data}, {args.e2e_steps} steps, "
          f"batch {args.e2e_batch}x{args.seq_len}, emulated outer link {args.e2e_link}, "
          f"{args.e2e_parallel} at a time", flush=True)
    from gpu_target import cli_env  # benchmarks/gpu_target.py

    env = cli_env()

    def one(name: str, flags: list[str]) -> dict:
        run = root / f"e2e-{name.replace(' ', '-')}"
        argv = [sys.executable, "-m", "lowband.cli", "train", "--no-progress", "--run-dir",
                str(run),
                "--device", device.type, "--model", model, "--steps", str(args.e2e_steps),
                "--data", args.e2e_data, "--seq-len", str(args.seq_len),
                "--batch-size", str(args.e2e_batch),
                "--sync-every", "8", "--eval-every", "0", "--eval-batches", "1",
                "--precision", args.precision, "--link-bandwidth", args.e2e_link,
                "--link-latency", "0ms", *flags]
        t0 = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
        row = {"algo": name, "seconds": time.perf_counter() - t0, "ok": proc.returncode == 0,
               "beside": args.e2e_parallel - 1}
        if proc.returncode == 0:
            summary = json.loads((run / "summary.json").read_text())
            config = json.loads((run / "config.json").read_text())
            share, n, cuda = hidden_share(run)
            losses = [e["loss"] for e in read_events(run, ("step",)) if e["rank"] == 0]
            row.update(ran=config["algo"], backend=config["meta"]["backend"],
                       world=config["meta"]["world"],
                       tokens_per_s=summary["tokens_per_s"], hidden=share, comm_events=n,
                       cuda_timed=cuda, val_loss=summary["final_val_loss"],
                       first_loss=losses[0], last_loss=losses[-1], steps=summary["steps"],
                       n_params=config["meta"]["n_params"])
        else:
            tail = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
            row["error"] = " | ".join(tail[-3:])[:400]
        _print_e2e(row)
        return row

    # --e2e-parallel N: N runs share the GPU at a time (their tokens/s then share it too)
    with ThreadPoolExecutor(args.e2e_parallel) as pool:
        return list(pool.map(lambda item: one(*item), args.e2e_algos.items()))


def _print_e2e(r: dict) -> None:
    """One row as soon as its run ends (a call cut short keeps what it printed)."""
    if not r["ok"]:
        print(f"  {r['algo']:<10} FAILED: {r['error']}")
        return
    hidden = "-" if r["hidden"] != r["hidden"] else f"{100 * r['hidden']:.0f}%"
    print(f"  {r['algo']:<10} {r['backend']} x{r['world']}  {r['tokens_per_s']:>10,.0f} tokens/s  "
          f"outer transfer time hidden {hidden:>5}  comm events {r['comm_events']} "
          f"({r['cuda_timed']} CUDA-timed)  loss {r['first_loss']:.2f} -> {r['last_loss']:.2f}, "
          f"val {r['val_loss']:.3f}", flush=True)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: check the script anywhere")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--json", help="also write every row to this file")
    p.add_argument("--keep-runs", help="copy the run directories here (for `lowband report`)")
    p.add_argument("--overhead", help="the overhead section's rows to run, comma-separated "
                                      f"(default: all of {', '.join(OVERHEAD_ALGOS)})")
    p.add_argument("--ddp-tokens-per-s", type=float,
                   help="for the target section without the overhead one: ddp's tokens/s at a "
                        "world of one, measured at this batch")
    p.add_argument("--e2e-steps", type=int, help="steps of each e2e run (default 16; smoke 4)")
    p.add_argument("--e2e", help="the e2e section's rows to run, comma-separated (default: all "
                                 f"of {', '.join(E2E)}; smoke: ddp, streaming)")
    p.add_argument("--e2e-parallel", type=int, default=1,
                   help="e2e runs sharing the GPU at a time (default 1: their tokens/s alone)")
    p.add_argument("--target-seconds", type=float,
                   help="training seconds of each time-to-target run (default 180; smoke 5)")
    args = p.parse_args(argv)
    dev = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    args.device = torch.device(dev)
    big = not args.smoke
    args.model, args.seq_len, args.batch_size = ("gpt2", 1024, 16) if big else ("nano", 64, 4)
    args.precision = "bf16"
    args.warm, args.steps, args.repeats = (10, 30, 2) if big else (3, 4, 1)
    args.compile_modes = ["", "compile"] if big else [""]
    args.sync_every = 20 if big else 4
    args.codec_numel = 2 ** 28 if big and dev == "cuda" else 2 ** 16
    # e2e: every algorithm on a Hugging Face Llama of GPT-2's size, on the prepared corpus
    # (gpu_target.py make) where it is there; a 10 Gbit/s link keeps ddp's steps short
    corpus = Path(__file__).resolve().parents[1] / ".gpu" / "corpus"
    data = str(corpus) if big and (corpus / "meta.json").exists() else "builtin"
    args.e2e_model, args.e2e_link = "llama", "10gbit"
    args.e2e_steps = args.e2e_steps or (16 if big else 4)
    args.overhead = [s.strip() for s in args.overhead.split(",")] if args.overhead else None
    args.e2e_batch, args.e2e_data = (8 if big else 4), data
    args.target_data = data
    args.target_seconds = args.target_seconds or (180.0 if big else 5.0)
    e2e = ([s.strip() for s in args.e2e.split(",")] if args.e2e else
           list(E2E) if big else ["ddp", "streaming"])
    if set(e2e) - set(E2E):
        p.error(f"unknown e2e row(s) {', '.join(sorted(set(e2e) - set(E2E)))}: use "
                f"{', '.join(E2E)}")
    args.e2e_algos = {k: E2E[k] for k in e2e}
    args.sections = [s for s in args.sections.split(",") if s]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown section(s) {', '.join(sorted(unknown))}: use {', '.join(SECTIONS)}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.set_num_threads(os.cpu_count() or 1)  # as the trainer sets it for a world of one
    print(f"device: {device_name(args.device)}; torch {torch.__version__}"
          + (f", CUDA {torch.version.cuda}" if args.device.type == "cuda" else ""))
    out = {"device": device_name(args.device), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        args.results = out
        for name in args.sections:
            t0 = time.perf_counter()
            out[name] = globals()[f"section_{name}"](args, args.device, root)
            print(f"[{name}] took {time.perf_counter() - t0:.0f} s", flush=True)
            if args.json:  # after each section: a call cut short keeps what it finished
                Path(args.json).write_text(json.dumps(out, indent=2, default=str))
        if args.keep_runs:
            shutil.copytree(root, args.keep_runs, dirs_exist_ok=True,  # records, not weights
                            ignore=shutil.ignore_patterns("*.pt", "checkpoints"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
