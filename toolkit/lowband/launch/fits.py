"""Whether a run fits this machine, asked before any worker starts: its ranks against the cores
and its workers' memory, estimated, against the memory available. A run that cannot fit is
refused in one sentence naming the flags to lower (--oversubscribe starts it anyway); one that
fits badly starts with a note. `lowband train` asks here (launch/here.py) for its R x S workers,
and a worker under torchrun asks on rank 0's node for the ranks there (cli.py).
"""

from __future__ import annotations

import math
import os
import sys

from lowband.algorithms import ALGORITHMS
from lowband.algorithms.outer import OuterOptions
from lowband.config import Config, ConfigError
from lowband import models

CORES_REFUSED = 4  # more ranks than 4 a core: refused (more than one a core: a note)
MEMORY_NOTED = 0.7  # workers estimated above 70% of the memory available: a note
BASE_BYTES = 0.45e9  # a worker's Python, torch and lowband before its model (measured)
GB = 1e9


def worker_bytes(cfg: Config) -> tuple[float, float]:
    """A worker's peak memory on the CPU, estimated: (the model's share, the activations'), in
    bytes, beside BASE_BYTES. The model: its parameters (4 bytes each) as weights, gradients and
    AdamW's two moments, and an outer algorithm's outer weights and momentum (diloco,
    streaming, edit, aedit). The activations of one micro-batch (--batch-size x --seq-len
    tokens): about 16 floats a token, a block and a unit of width (the blocks' inputs, norms,
    q/k/v, attention out, the MLP's 4x hidden twice), and 3 floats a token and a word of the
    vocabulary (the logits, their softmax, their gradient).

    Calibrated on one worker (its ru_maxrss over 2 steps, fp32 on the CPU, torch 2.x) against
    the estimate, base included, in GB measured / estimated: the main job 0.48 / 0.51; nano
    0.46 / 0.46; --seq-len 4096 1.73 / 1.66; nano --seq-len 4096 0.80 / 0.83; nano --seq-len
    16384 --batch-size 2 0.87 / 0.85; --seq-len 32768 --batch-size 1 1.90 / 1.74; --model
    small 1.27 / 1.33 (ddp 1.05 / 1.13); --model mini --batch-size 32 1.04 / 0.98: within 10%,
    where 2x was the aim. (RSS counts the libraries workers share once per worker, so the
    sum over workers errs high, by about 0.1 GB a worker.)"""
    spec = models.spec(cfg.model)
    params = spec.param_count(cfg.n_layer, cfg.d_model, cfg.vocab_size, cfg.seq_len)
    layers = spec.n_blocks(cfg.n_layer)
    width = cfg.d_model or getattr(spec, "d_model", 0) or math.sqrt(params / (12 * layers))
    vocab = cfg.vocab_size or spec.vocab_size
    copies = 4 + (2 if OuterOptions in ALGORITHMS[cfg.algo].options else 0)
    tokens = cfg.batch_size * cfg.seq_len
    return 4.0 * params * copies, 4.0 * tokens * (16 * layers * width + 3 * vocab)


def refusals(cfg: Config, ranks: int, cores: int, available: float | None,
             on_cpu: bool = True) -> tuple[list[str], list[str]]:
    """(what refuses the run, what is only noted), each a sentence, for `ranks` workers of cfg
    on a machine of `cores` cores and `available` bytes of memory free (None: unknown, not
    checked). on_cpu: the workers train on the CPU (on a GPU, their activations are the
    device's, and only the cores are checked)."""
    refused, noted = [], []
    layout = f"--replicas {cfg.replicas} x --shards {cfg.shards}" + (
        "" if ranks == cfg.world else ", this node's share")  # (under torchrun)
    if ranks > CORES_REFUSED * cores:
        refused.append(f"{ranks} ranks ({layout}) on this machine's {cores} cores would crawl, "
                       f"more than {CORES_REFUSED} a core: lower --replicas or --shards.")
    elif ranks > cores:
        noted.append(f"{ranks} ranks ({layout}) share this machine's {cores} cores, so each step "
                     "is slower than with a core a rank.")
    if on_cpu and available is not None:
        model, activations = worker_bytes(cfg)
        each = BASE_BYTES + model + activations
        if activations > model:
            what = f"--seq-len {cfg.seq_len} with --batch-size {cfg.batch_size}"
            fix = "lower --seq-len, --batch-size or --replicas"
        else:
            what, fix = f"--model {cfg.model}", "pick a smaller --model or lower --replicas"
        need = (f"{what} needs about {each / GB:.1f} GB a worker, {ranks * each / GB:.1f} GB "
                f"for {ranks} workers, and this machine has {available / GB:.1f} GB available")
        if ranks * each > available:
            refused.append(f"{need}: {fix}.")
        elif ranks * each > MEMORY_NOTED * available:
            noted.append(f"{need}: the run may swap, or be stopped for memory.")
    return refused, noted


def fit_here(cfg: Config, ranks: int | None = None, notes: bool = True) -> None:
    """Refuse (ConfigError) a run that cannot fit this machine, or print its notes: `ranks`
    workers (default: the run's R x S) on this machine's cores (those this process may run on)
    and its memory available (/proc/meminfo's MemAvailable; unknown elsewhere: not checked).
    With --oversubscribe the refusals are notes. notes=False: refusals only (under torchrun,
    whose layout its user chose, a note would only add a line to every job's log)."""
    from lowband.comm.topology import pick_device

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    refused, noted = refusals(cfg, ranks or cfg.world, cores or 1, available_bytes(),
                              on_cpu=pick_device(cfg.device).type == "cpu")
    if refused and not cfg.oversubscribe:
        raise ConfigError(f"{refused[0][:-1]}, or pass --oversubscribe to start anyway.")
    for note in [*refused, *noted] if notes else []:
        print(f"lowband: note: {note}", file=sys.stderr)


def available_bytes() -> float | None:
    """The memory this machine can give without swapping (MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None
