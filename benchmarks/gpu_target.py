"""Time to target on a real model: ddp against streaming (fp4) with two ranks on one GPU, joined
by an emulated outer link, each given the same wall-clock budget; validation loss against
training time, and how much sooner streaming reaches the loss ddp ends with.

  make  on any machine (here, a CPU one): the corpus and its tokenizer. The text is this
        Python's standard library (lowband's `builtin` files) and the installed torch
        package's *.py files, each file a document; a byte-level BPE of 50,257 tokens (GPT-2's
        count, `<|endoftext|>` included) is trained on the standard library part, and
        `lowband prepare` writes the token shards. Nothing is downloaded.
  run   on the GPU: `lowband train --model gpt2` (GPT-2 124M) for each algorithm. Without a
        time budget in the trainer, each run's --steps is sized to fill the budget from lowband's
        own planner (compute per step measured by the caller, plus the link stall the planner
        predicts), so each learning-rate schedule spans its run; the measured training time is
        reported beside the prediction.

Training time excludes evaluations (the trainer's step_s; rank 0's clock). Time to ddp's final
loss is read at streaming's first evaluation at or below it (an upper bound: evaluations are
about a twentieth of the run apart).

    python benchmarks/gpu_target.py make --out .gpu                  # here: corpus + tokenizer
    PYTHONPATH=toolkit python3 benchmarks/gpu_target.py run --data .gpu/corpus \
        --step-time 0.11 --seconds 180 --json target.json           # there
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 50257  # GPT-2's tokenizer size; the gpt2 preset's 50,304 rows cover it

# ddp's gradients and streaming's fragments over the same link; the rest is common to both
RUNS = {
    "ddp": ["--algo", "ddp"],
    "streaming": ["--algo", "streaming", "--fragments", "4", "--sync-every", "20",
                  "--overlap", "2", "--codec", "fp4-e3m0"],
}
COMMON = {"model": "gpt2", "seq_len": 1024, "batch_size": 16, "replicas": 2, "lr": 6e-4,
          "min_lr_ratio": 0.1, "precision": "bf16", "eval_batches": 8}


# ---------------------------------------------------------------- make (any machine)


def make(out: Path, workers: int | None) -> None:
    import sysconfig

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from lowband.data import stdlib_files

    out.mkdir(parents=True, exist_ok=True)
    src = out / "src"
    shutil.rmtree(src, ignore_errors=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    torch_root = Path(torch.__file__).parent
    parts = [("a-stdlib", stdlib, stdlib_files()),
             ("b-torch", torch_root, sorted(p for p in torch_root.rglob("*.py")
                                           if "__pycache__" not in p.parts))]
    for name, root, files in parts:
        for f in files:
            dst = src / name / f.relative_to(root)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dst)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    t0 = time.perf_counter()
    texts = (p.read_text(encoding="utf-8", errors="replace")  # as `lowband prepare` reads them
             for p in sorted((src / "a-stdlib").rglob("*.py")))
    tok.train_from_iterator(texts, trainer)
    tok.save(str(out / "tokenizer.json"))
    print(f"tokenizer: {tok.get_vocab_size()} tokens in {time.perf_counter() - t0:.0f} s")
    argv = [sys.executable, "-m", "lowband.cli", "prepare", str(src), "-o", str(out / "corpus"),
            "--tokenizer", str(out / "tokenizer.json"), "--no-progress", "--overwrite"]
    if workers:
        argv += ["--workers", str(workers)]
    subprocess.run(argv, check=True)
    meta = json.loads((out / "corpus" / "meta.json").read_text())
    shutil.rmtree(src)
    print(f"corpus: {out / 'corpus'}, python {sysconfig.get_python_version()}, torch "
          f"{torch.__version__}: " + ", ".join(f"{k} {v}" for k, v in meta.items()
                                              if isinstance(v, (int, float, str)))[:300])


# ---------------------------------------------------------------- run (the GPU)


def planned_steps(algo_flags: list[str], step_time: float, seconds: float, link: str,
                  common: dict | None = None) -> tuple[int, float]:
    """(steps that fill `seconds`, predicted seconds a step) from lowband's planner: compute
    step_time a step plus the stall it predicts for this algorithm on the link."""
    from lowband.flags import parse_train
    from lowband.plan import run_of, simulate

    over = {**(common or {}), "link_bandwidth": link, "link_latency": "0ms", "steps": 100}
    cfg = parse_train(_flags(algo_flags, over))[0]
    sim = simulate(cfg.algo, run=run_of(cfg, step_time, steady=True))
    per_step = step_time + sim.stall_per_step
    return max(int(seconds / per_step), 4), per_step


def _flags(algo_flags: list[str], over: dict) -> list[str]:
    argv = list(algo_flags)
    for k, v in {**COMMON, **over}.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


def cli_env() -> dict:
    """The environment of a `lowband train` started from a benchmark: the CLI starts its own
    ranks (no torchrun variables of the benchmark's world of one), lowband from this checkout."""
    torchrun = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in torchrun}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "toolkit"), os.environ.get("PYTHONPATH", "")])
    return env


def curve(run: Path) -> list[dict]:
    """Rank 0's evaluations with the training time (sum of step_s) and tokens (all ranks) so far."""
    from lowband.telemetry import read_events

    events = [e for e in read_events(run, ("step", "eval")) if e["rank"] == 0]
    world = json.loads((run / "config.json").read_text())["meta"]["world"]
    out, spent, tokens = [], 0.0, 0
    for e in events:
        if e["kind"] == "step":
            spent += e["step_s"]
            tokens = e["tokens"] * world
        else:
            out.append({"step": e["step"], "seconds": spent, "tokens": tokens,
                        "val_loss": e["val_loss"]})
    return out


def run_one(name: str, data: str, root: Path, steps: int, link: str, device: str,
            limit: float, common: dict | None = None) -> dict:
    run = root / f"target-{name}"
    over = {**(common or {}), "data": data, "steps": steps, "link_bandwidth": link,
            "link_latency": "0ms", "device": device,
            "run_dir": run, "eval_every": max(steps // 20, 1),
            "warmup_steps": max(steps // 20, 2)}
    argv = [sys.executable, "-m", "lowband.cli", "train", "--no-progress",
            *_flags(RUNS[name], over)]
    env = cli_env()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=limit)
        ok, tail = proc.returncode == 0, (proc.stderr + proc.stdout).strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        ok, tail = False, [f"stopped after {limit:.0f} s"]
    row = {"algo": name, "steps": steps, "ok": ok, "process_s": time.perf_counter() - t0,
           "curve": curve(run) if (run / "config.json").exists() else []}
    if ok:
        s = json.loads((run / "summary.json").read_text())
        row.update(tokens_per_s=s["tokens_per_s"], wall_s=s["wall_s"],
                   compute_utilization=s.get("compute_utilization"),
                   outer_wire_bytes=s.get("outer_wire_bytes"), final_val_loss=s["final_val_loss"])
    else:
        row["error"] = " | ".join(tail)[:400]
    return row


def compare(rows: dict) -> dict:
    """How much sooner the second run reaches the first's final loss (ddp's, by default)."""
    base, other = rows["ddp"], rows["streaming"]
    if not (base["curve"] and other["curve"]):
        return {}
    target, t_base = base["curve"][-1]["val_loss"], base["curve"][-1]["seconds"]
    hit = next((p for p in other["curve"] if p["val_loss"] <= target), None)
    out = {"target_loss": target, "ddp_seconds": t_base,
           "streaming_seconds": hit["seconds"] if hit else None,
           "streaming_tokens": hit["tokens"] if hit else None}
    if hit:
        out["sooner"] = t_base / max(hit["seconds"], 1e-9)
    # loss of each at the shorter run's end: equal training time
    t = min(base["curve"][-1]["seconds"], other["curve"][-1]["seconds"])
    out["equal_time_s"] = t
    for name, r in rows.items():
        before = [p for p in r["curve"] if p["seconds"] <= t + 1e-6]
        out[f"{name}_loss_at_equal_time"] = before[-1]["val_loss"] if before else None
    return out


def run_all(data: str, step_time: float, seconds: float, link: str = "1gbit",
            device: str = "cuda", root: Path | None = None, common: dict | None = None) -> dict:
    """Both runs in turn; common: overrides of COMMON (a smaller model for a smoke run)."""
    import tempfile

    root = Path(root or tempfile.mkdtemp(prefix="lowband-target-"))
    rows = {}
    model = {**COMMON, **(common or {})}["model"]
    print(f"\n[target] {model}, 2 ranks, link {link}, budget {seconds:.0f} s each, compute "
          f"{step_time * 1e3:.0f} ms a step (measured); data {data}", flush=True)
    for name in RUNS:
        steps, per_step = planned_steps(RUNS[name], step_time, seconds, link, common)
        row = run_one(name, data, root, steps, link, device, max(3 * seconds, seconds + 120), common)
        row["predicted_step_s"] = per_step
        rows[name] = row
        _print_row(row)
    result = {"runs": rows, "compare": compare(rows), "link": link, "budget_s": seconds}
    c = result["compare"]
    if c.get("sooner"):
        print(f"  streaming reached ddp's final val loss {c['target_loss']:.3f} after "
              f"{c['streaming_seconds']:.1f} s of training, ddp after {c['ddp_seconds']:.1f} s: "
              f"{c['sooner']:.1f}x sooner; at {c['equal_time_s']:.0f} s: ddp "
              f"{c['ddp_loss_at_equal_time']:.3f}, streaming {c['streaming_loss_at_equal_time']:.3f}",
              flush=True)
    elif c:
        print(f"  streaming did not reach ddp's final val loss {c['target_loss']:.3f}", flush=True)
    return result


def _print_row(r: dict) -> None:
    pts = " ".join(f"{p['seconds']:.0f}s:{p['val_loss']:.3f}" for p in r["curve"])
    if r["ok"]:
        print(f"  {r['algo']:<10} {r['steps']} steps, {r['wall_s']:.1f} s training (predicted "
              f"{r['steps'] * r['predicted_step_s']:.0f}), {r['tokens_per_s']:,.0f} tokens/s, "
              f"compute utilization {r['compute_utilization']:.0%}, val loss {r['final_val_loss']:.3f}",
              flush=True)
    else:
        print(f"  {r['algo']:<10} FAILED: {r['error']}", flush=True)
    print(f"    val loss by training time: {pts}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="the corpus and its tokenizer (any machine)")
    m.add_argument("--out", default=".gpu")
    m.add_argument("--workers", type=int)
    r = sub.add_parser("run", help="the two runs (a GPU)")
    r.add_argument("--data", default=".gpu/corpus")
    r.add_argument("--step-time", type=float, required=True,
                   help="compute seconds a step of one replica, measured (two ranks share the GPU)")
    r.add_argument("--seconds", type=float, default=180.0)
    r.add_argument("--link", default="1gbit")
    r.add_argument("--device", default="cuda")
    r.add_argument("--json")
    a = p.parse_args(argv)
    if a.cmd == "make":
        make(Path(a.out), a.workers)
        return 0
    result = run_all(a.data, a.step_time, a.seconds, a.link, a.device)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
