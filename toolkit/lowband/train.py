"""The one training loop, used by every algorithm.

Run inside a process group that torchrun, TorchX or `lowband train` set up (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT in the environment). `train(config)` builds lowband's GPT;
`train(config, model=my_module)` trains a user's own nn.Module that maps (B, T) token ids to
(B, T, V) logits (a tensor, or an output with `.logits` as Hugging Face models return), whose
blocks are a Hugging Face model's decoder layers or found by `find_blocks` (or passed as
`blocks=`). `--model hf:PATH` builds a Hugging Face model from local files (models/hf.py).
What comes before the loop (the run directory, a relaunch, the attempt, the checkpoint to
resume from) is checkpoint/lifecycle.py's.
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch
import torch.nn as nn

from lowband.algorithms.inner import make_optimizer_factory
from lowband.algorithms.pace import accums
from lowband.checkpoint.preempt import HANDLER as preempt, stopped
from lowband.clock import RunClock
from lowband.comm import topology as topo_mod
from lowband.comm.membership.elastic import replica_of_env
from lowband.config import Config
from lowband.data import Batches, load_corpus, record_tokenizer, vocab_needed
from lowband.faults import Faults
from lowband.models import blocks_of, check_vocab, compile_blocks, for_training, lm_loss
from lowband.models import build as build_model
from lowband.options import UserError
from lowband.params import is_dtensor
from lowband.session import Session
from lowband.telemetry import EventWriter


def _set_threads() -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(topo_mod.local_world_size(), 1)))


def evaluate(model, batches: Batches, cfg: Config) -> float:
    was_training = model.training
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(cfg.eval_batches):
            x, y = batches.val(i)
            total += lm_loss(model, x, y, cfg.precision).item()
    model.train(was_training)
    return total / cfg.eval_batches


def train(cfg: Config, model: nn.Module | None = None, blocks: nn.ModuleList | None = None,
          resume: bool = False) -> dict | None:
    """Train on this process's rank. Returns the summary on rank 0, None elsewhere.
    resume: continue cfg.run_dir from its latest checkpoint (events continue in its files)."""
    if model is not None:  # options sized by blocks are checked against this model's
        blocks = blocks if blocks is not None else blocks_of(model)
        cfg.model_blocks = len(blocks)
    cfg.validate()
    _set_threads()
    topo = topo_mod.init(cfg.replicas, cfg.shards, cfg.device, cfg.backend,
                         replica=replica_of_env() if cfg.elastic else None)
    tokens = load_corpus(cfg.data, cfg.tokenizer)
    if model is None:  # before the run directory is touched: bad input loses nothing
        check_vocab(cfg, vocab_needed(tokens))
    session = Session(cfg, topo, resume, faults=Faults(cfg, topo.replica, cfg.seed, topo.rank))
    session.faults.logs = session.run.root / "logs"  # (--corrupt's and --kill's markers)
    try:
        return _train(session, tokens, model, blocks)
    finally:
        session.close()


def _train(session: Session, tokens, model, blocks):
    cfg, topo, run = session.cfg, session.topo, session.run
    device = topo.device
    batches = Batches(tokens, rank=topo.rank, world=topo.world, seq_len=cfg.seq_len,
                      batch_size=cfg.batch_size, seed=cfg.seed, val_fraction=cfg.val_fraction,
                      device=device)
    torch.manual_seed(cfg.seed)
    user_model = model is not None
    if not user_model:  # built from the seed (or read from files): the same on every rank
        model = build_model(cfg, vocab_needed(tokens))
    session.vocab = vocab_needed(tokens)  # (summary.json: a loss above a uniform guess diverged)
    model = for_training(model).to(device)
    blocks = blocks if blocks is not None else blocks_of(model)
    if cfg.compile:
        compile_blocks(blocks)
    optimizer = session.set_up(model, blocks, make_optimizer_factory(cfg, device, blocks),
                               broadcast=user_model,
                               meta={"tokenizer": record_tokenizer(tokens, run.root)})
    algo, comm, faults = session.algo, session.comm, session.faults
    # aedit's replicas evaluate at steps of their own: only its final evaluation is everyone's
    lockstep = not algo.timed
    model.train()
    # training seconds (a resume's spent before it); --time-budget: rank 0's clock decides for
    # every rank (clock.py), but aedit keeps it at its syncs
    done = session.begin(None if algo.timed else cfg.time_budget)
    clock = session.clock
    bar = _progress(cfg, topo.rank, _bar_at(cfg, algo, clock, done.step - 1) if done.step else 0)
    # a resumed run whose budget was spent ends at once
    time_up = clock.ends_after(session.run_step())
    preempt.start(cfg, algo)  # SIGTERM, SIGUSR1: every rank stops after one step, checkpointed
    signalled = 0
    while not time_up:
        t0 = time.perf_counter()
        if algo.should_stop(done.step):  # after --steps by default; aedit decides (and syncs)
            break                        # here, elastic ddp takes its quorum
        session.take_heal()
        step = done.step
        if algo.owns_step:  # e.g. acco: micro-batches accumulate while its round is in flight
            loss, micro_batches = algo.train_step(step, batches, algo.lr(step))
        else:
            loss, micro_batches = standard_step(algo, model, optimizer, batches, cfg, step,
                                                session.events)
        if algo.skips > cfg.max_skips:
            raise TrainingStopped(f"{algo.skips} updates in a row held NaN or inf (the last at "
                                  f"step {step + 1}), so training stopped: lower --lr, check the "
                                  "data, or resume from the last checkpoint.")
        faults.maybe_die(step + 1, run.root)
        if faults.after_step(step + 1, model):
            session.events.emit("fault", step=step + 1, what="corrupt", how="noise",
                                scale=faults.corrupt.value)
        stalled = faults.slow_down(step + 1, time.perf_counter() - t0 - comm.wait_s,
                                   clock.seconds(), session.events)  # a stall is no step time
        elapsed = session.stepped(loss, micro_batches * cfg.batch_size * cfg.seq_len,
                                  time.perf_counter() - t0 - stalled, algo.lr(step))
        at = algo.run_step(step + 1)  # where every replica is too (None: between syncs)
        # --time-budget: decided where every rank is (after the event: it moves the lr's fraction)
        time_up = at is not None and clock.ends_after(at)
        ends = algo.ends_after(step + 1) or time_up  # the final evaluation follows the loop
        signalled = preempt.stops(at, ends)  # (a collective every few steps, where noted)
        with clock.paused():
            if cfg.eval_every and at is not None and at % cfg.eval_every == 0 and not ends:
                session.evaluate(lambda: _val_loss(session, batches), elapsed, lockstep, at)
            session.maybe_checkpoint(step + 1, ends or at == cfg.stop_after, now=bool(signalled))
        if bar is not None:
            tok_s = done.tokens * topo.world / max(clock.seconds(), 1e-9)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:.0f}")
            bar.update(max(min(_bar_at(cfg, algo, clock, step), bar.total) - bar.n, 0))
        if at == cfg.stop_after or signalled:
            break
    if signalled:  # one sentence and exit status 5: where it stopped, how it continues
        if bar is not None:
            bar.close()
        raise stopped(session, signalled, at)
    # exchanges still in flight land before the final evaluation
    summary = session.finish(lambda: _val_loss(session, batches),
                             sum(accums(cfg)) * cfg.shards * cfg.batch_size * cfg.seq_len)
    if bar is not None:
        bar.close()
    return summary


def standard_step(algo, model, optimizer, batches: Batches, cfg: Config, step: int,
                  events: EventWriter | None = None) -> tuple[float, int]:
    """One inner step with the algorithm's hooks (algorithms/base.py lists them in order).
    Returns this rank's loss (mean over its micro-batches) and the micro-batches it used."""
    lr = algo.lr(step)
    for g in optimizer.param_groups:
        g["lr"] = lr
    device = next(model.parameters()).device
    algo.before_forward(step)
    loss_sum = torch.zeros((), device=device)
    accum = algo.micro_batches()  # (--replica-accum: this replica's)
    for micro in range(accum):
        x, y = batches.train(step, micro)
        loss = lm_loss(model, x, y, cfg.precision) / accum
        algo.before_backward(step, micro, micro == accum - 1)
        loss.backward()
        loss_sum += loss.detach()
    algo.after_backward(step)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
    finite = torch.isfinite(norm)
    on_device = _skips_on_device(optimizer)
    if on_device:  # queued before the host waits on `finite`, so the GPU does not idle
        optimizer.found_inf = (~finite).float()
        optimizer.step()
    if finite:
        if not on_device:
            optimizer.step()
        algo.skips = 0
    else:  # NaN or inf in the loss or a gradient: this update is skipped, the weights stay
        algo.skips += 1
        if events is not None:
            events.emit("skip", step=step + 1, what="gradient")
    optimizer.zero_grad(set_to_none=True)
    algo.after_step(step)
    return loss_sum.item(), accum


def _skips_on_device(optimizer) -> bool:
    """Whether the optimizer's step can skip itself on the device: a fused AdamW reads
    `found_inf` as under a GradScaler and leaves parameters, moments and step counts as they
    were when it is 1 (plain tensors only: DTensor parameters take the host's decision)."""
    params = optimizer.param_groups[0]["params"]
    return bool(optimizer.defaults.get("fused")) and bool(params) and not is_dtensor(params[0])


class TrainingStopped(UserError, RuntimeError):
    """The run cannot go on; the message is one sentence naming what to do."""
    code, label = 3, ""


def _val_loss(session: Session, batches: Batches) -> float:
    """The validation loss of the weights the run evaluates (--eval-params: local or outer)."""
    with session.algo.eval_weights(session.cfg.eval_params):
        return evaluate(session.model, batches, session.cfg)


def _progress(cfg: Config, rank: int, initial: int = 0):
    """Rank 0's bar: steps of --steps, or with --time-budget seconds of it. Drawn only on a
    terminal: into a redirected log it would write a line a step (it still counts there)."""
    if rank != 0 or not cfg.progress:
        return None
    from tqdm import tqdm

    total, unit = (math.ceil(cfg.time_budget), "s") if cfg.time_budget else (cfg.steps, "it")
    return tqdm(total=total, initial=initial, desc=f"{cfg.algo} R={cfg.replicas} S={cfg.shards}",
                unit=unit, file=sys.stderr, mininterval=0.5, dynamic_ncols=True,
                disable=not sys.stderr.isatty())


def _bar_at(cfg: Config, algo, clock: RunClock, step: int) -> int:
    """Where the bar stands once step `step` (0-based) is taken: the steps (acco and aedit
    count their budgets) or the training seconds."""
    return int(clock.seconds()) if cfg.time_budget else int(algo.progress_steps(step))
