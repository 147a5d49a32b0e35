"""lowband's ddp against torch.nn.parallel.DistributedDataParallel, side by side in one run.

Both train their own copy of the same model on the same batches in the same processes; steps
alternate between the two (ABBA order), so machine noise hits both alike. Prints the median
step time of each and their ratio (goal: lowband / torch <= 1.10).

    python benchmarks/ddp_overhead.py [--ranks 2] [--model mini | --model hf:DIR | --llama]
        [--steps 30]

--model hf:DIR trains a Hugging Face causal LM from a local config directory (its decoder layers
are lowband's blocks); --llama writes a Llama of about mini's size (machine.LLAMA_MINI: 6 layers,
hidden 256, 4.8M parameters) into a temp dir and uses that.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from machine import describe, model_line, write_llama_mini  # benchmarks/machine.py
from lowband.comm import topology
from lowband.algorithms.ddp import DDP
from lowband.comm import Comm
from lowband.config import Config
from lowband.data import Batches, load_tokens
from lowband.launch.local import free_port
from lowband.options import ConfigError
from lowband.models import lm_loss
from lowband.telemetry import EventWriter, RunDir
from lowband.models import blocks_of
from lowband.train import build_model, make_optimizer_factory


def worker(rank: int, args, port: int, out_dir: str, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.ranks), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(args.ranks))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.ranks))
    cfg = Config(model=args.model, replicas=args.ranks, batch_size=args.batch_size,
                 seq_len=args.seq_len, bucket_mb=args.bucket_mb)
    topo = topology.init(cfg.replicas, cfg.shards)
    tokens = load_tokens("builtin")
    data = Batches(tokens, rank=rank, world=args.ranks, seq_len=cfg.seq_len,
                   batch_size=cfg.batch_size, seed=0, val_fraction=cfg.val_fraction)
    make_opt = make_optimizer_factory(cfg, topo.device)

    torch.manual_seed(0)
    ours = build_model(cfg, 256)
    events = EventWriter(RunDir(out_dir), rank, rank)
    algo = DDP()
    opt_ours = algo.setup(ours, blocks_of(ours), make_opt, topo, Comm(topo, events), cfg)

    torch.manual_seed(0)
    ref_model = build_model(cfg, 256)
    theirs = DistributedDataParallel(ref_model, bucket_cap_mb=args.bucket_mb)
    opt_theirs = make_opt(theirs.parameters())

    def step_ours(step):
        x, y = data.train(step)
        algo.before_forward(step)
        loss = lm_loss(ours, x, y)
        algo.before_backward(step, 0, True)
        loss.backward()
        algo.after_backward(step)
        torch.nn.utils.clip_grad_norm_(ours.parameters(), 1.0)
        opt_ours.step()
        opt_ours.zero_grad(set_to_none=True)
        algo.after_step(step)
        return loss.item()

    def step_theirs(step):
        x, y = data.train(step)
        loss = lm_loss(theirs, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0)
        opt_theirs.step()
        opt_theirs.zero_grad(set_to_none=True)
        return loss.item()

    times = {"lowband": [], "torch": []}
    losses = {"lowband": [], "torch": []}
    for step in range(args.warmup + args.steps):
        order = [("lowband", step_ours), ("torch", step_theirs)]
        for name, fn in order if step % 2 == 0 else order[::-1]:
            dist.barrier()
            t0 = time.perf_counter()
            loss = fn(step)
            dist.barrier()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - t0)
            losses[name].append(loss)
    events.close()
    if rank == 0:
        results.put((times, losses))
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--model", default="mini", help="a preset or hf:DIR (default mini)")
    p.add_argument("--llama", action="store_true",
                   help="a Llama of about mini's size, written to a temp dir (replaces --model)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--bucket-mb", type=float, default=4.0)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as out:
        if args.llama:
            args.model = write_llama_mini(out, args.seq_len)
        try:  # before the workers: an unusable --model stops here, in one line
            model = model_line(args.model, args.seq_len)
        except ConfigError as e:
            p.error(str(e))
        print(f"machine: {describe(load=True)}", flush=True)
        mp.spawn(worker, args=(args, free_port(), out, results), nprocs=args.ranks)
        times, losses = results.get()
    med = {k: statistics.median(v) for k, v in times.items()}
    drift = max(abs(a - b) for a, b in zip(losses["lowband"], losses["torch"]))
    print(f"model {model}, {args.ranks} ranks (gloo), batch {args.batch_size}x{args.seq_len}, "
          f"buckets {args.bucket_mb} MiB, {args.steps} steps each, alternating")
    print(f"  torch DDP      median step {1000 * med['torch']:.1f} ms")
    print(f"  lowband ddp    median step {1000 * med['lowband']:.1f} ms")
    print(f"  ratio lowband / torch = {med['lowband'] / med['torch']:.3f}  (goal <= 1.10, {model})")
    print(f"  largest loss difference between the two over all steps: {drift:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
