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

import hashlib
import math
import os
from dataclasses import dataclass, field
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from lowband import checkpoint
from lowband.checkpoint import lifecycle
from lowband.clock import RunClock
from lowband.comm import topology as topo_mod
from lowband.algorithms import ALGORITHMS
from lowband.algorithms.ddp import outer_wire_bytes as ddp_outer_wire_bytes
from lowband.comm import Comm
from lowband.comm.membership.elastic import membership, replica_of_env
from lowband.comm.link import LinkOptions
from lowband.config import Config
from lowband.data import Batches, load_corpus, record_tokenizer, vocab_needed
from lowband.faults import Faults
from lowband.ledger import Ledger
from lowband.models import blocks_of, check_vocab, compile_blocks, for_training, lm_loss, num_params
from lowband.models import build as build_model
from lowband.params import flatten, is_dtensor, write_flat
from lowband.summary import add_ddp_bytes, summarize
from lowband.telemetry import EventWriter, write_json_atomic


def make_optimizer_factory(cfg: Config, device: torch.device):
    """AdamW with weight decay on matrices and embeddings only (not on norms' scales)."""

    def make(params):
        params = [p for p in params if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        rest = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay},
                  {"params": rest, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                 fused=device.type == "cuda")

    return make


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
    start = lifecycle.begin(cfg, topo, resume)  # the run directory, a resume point, the attempt
    events = EventWriter(start.run, topo.rank, topo.replica)
    try:
        return _train(cfg, topo, start.run, events, tokens, model, blocks, start.resume_from,
                      start.attempt)
    finally:
        events.close()


def _train(cfg, topo, run, events, tokens, model, blocks, resume_from, attempt):
    device = topo.device
    batches = Batches(tokens, rank=topo.rank, world=topo.world, seq_len=cfg.seq_len,
                      batch_size=cfg.batch_size, seed=cfg.seed, val_fraction=cfg.val_fraction,
                      device=device)
    torch.manual_seed(cfg.seed)
    user_model = model is not None
    if not user_model:  # built from the seed (or read from files): the same on every rank
        model = build_model(cfg, vocab_needed(tokens))
    model = for_training(model).to(device)
    blocks = blocks if blocks is not None else blocks_of(model)
    if cfg.compile:
        compile_blocks(blocks)
    comm, algo, optimizer = set_up(cfg, topo, run, events, model, blocks,
                                   make_optimizer_factory(cfg, device), user_model,
                                   {"tokenizer": record_tokenizer(tokens, run.root)})
    faults = Faults(cfg, topo.replica, cfg.seed, topo.rank)
    ledger = Ledger(topo.shards, cfg.elastic)
    # aedit's replicas evaluate at steps of their own: only its final evaluation is everyone's
    lockstep = not getattr(algo, "timed", False)
    model.train()
    done = start_training(cfg, topo, events, model, optimizer, algo, comm, resume_from, attempt)
    # training seconds (a resume's spent before it); --time-budget: rank 0's clock decides for
    # every rank (clock.py), but aedit keeps it at its syncs
    clock = algo.clock = RunClock(None if algo.timed else cfg.time_budget, done.wall_s, device)
    bar = _progress(cfg, topo.rank, _bar_at(cfg, algo, clock, done.step - 1) if done.step else 0)
    time_up = clock.ends_after(done.step)  # a resumed run whose budget was spent ends at once
    while not time_up:
        t0 = time.perf_counter()
        if algo.should_stop(done.step):  # after --steps by default; aedit decides (and syncs)
            break                        # here, elastic ddp takes its quorum
        _take_heal(algo, done)
        step = done.step
        if algo.owns_step:  # e.g. acco: micro-batches accumulate while its round is in flight
            loss, micro_batches = algo.train_step(step, batches, algo.lr(step))
        else:
            loss, micro_batches = standard_step(algo, model, optimizer, batches, cfg, step, events)
        if algo.skips > cfg.max_skips:
            raise TrainingStopped(f"{algo.skips} updates in a row held NaN or inf (the last at "
                                  f"step {step + 1}), so training stopped: lower --lr, check the "
                                  "data, or resume from the last checkpoint.")
        faults.maybe_die(step + 1, run.root)
        if faults.after_step(step + 1, model):
            events.emit("fault", step=step + 1, what="corrupt", scale=faults.corrupt[2])
        faults.slow_down(time.perf_counter() - t0 - comm.wait_s)
        step_s = time.perf_counter() - t0
        step_compute = max(step_s - comm.take_wait_s(), 0.0)
        done.advance(loss, micro_batches * cfg.batch_size * cfg.seq_len, step_compute)
        _take_heal(algo, done)
        elapsed = clock.seconds()  # training seconds so far
        events.emit("step", step=step + 1, loss=loss, lr=algo.lr(step), tokens=done.tokens,
                    step_s=step_s, compute_s=step_compute, elapsed_s=elapsed)
        time_up = clock.ends_after(step + 1)  # (after the event: it moves the lr's fraction)
        ends = algo.ends_after(step + 1) or time_up  # the final evaluation follows the loop
        with clock.paused():
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and not ends:
                _eval(algo, model, batches, cfg, events, step + 1, done, elapsed, ledger, comm,
                      lockstep)
            last = ends or step + 1 == cfg.stop_after
            if cfg.checkpoint_every and ((step + 1) % cfg.checkpoint_every == 0 or last):
                _checkpoint(run, events, model, optimizer, algo, topo, comm, cfg, done,
                            clock.seconds(), faults)
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{done.tokens * topo.world / max(clock.seconds(), 1e-9):.0f}")
            bar.update(max(min(_bar_at(cfg, algo, clock, step), bar.total) - bar.n, 0))
        if step + 1 == cfg.stop_after:
            break
    algo.finish()  # exchanges still in flight land before the final evaluation
    done.wall_s = clock.seconds()  # training time only (a resume's included)
    _eval(algo, model, batches, cfg, events, done.step, done, done.wall_s, ledger, comm, True)
    if bar is not None:
        bar.close()
    return write_results(cfg, topo, run, events, model, algo, comm, done,
                         cfg.world * cfg.grad_accum * cfg.batch_size * cfg.seq_len)


def write_results(cfg, topo, run, events, model, algo, comm, done: "Progress",
                  tokens_per_step: int | None) -> dict | None:
    """The end of a run, after its final evaluation (every rank): the `run` end event, model.pt
    and outer.pt, and summary.json (--elastic: the group's file the launcher sums). Returns the
    summary on rank 0 of a non-elastic run. tokens_per_step: ddp's tokens a step over all ranks,
    for the ddp bytes it compares with (None: from the steps run). The trainer and lowband.Sync
    (sync/) end a run here."""
    outer = algo.outer_params()
    events.emit("run", phase="end", world=topo.world, config_hash=cfg.hash())
    my_tokens, wall_s, compute_s = done.tokens, done.wall_s, done.compute_s
    last_loss, val_loss = done.loss, done.val_loss

    mine = {"tokens": my_tokens, "steps": done.step, "wall_s": wall_s, "compute_s": compute_s,
            "loss": last_loss, "val_loss": val_loss, "replica": topo.replica, "shard": topo.shard,
            "evals": done.evals,
            "outer_wire": comm.totals.wire_bytes["outer"], "inner_wire": comm.totals.wire_bytes["inner"],
            "peak_outer": comm.totals.peak_outer_payload, "setup_wire": comm.totals.setup_wire_bytes}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    weights = _full_weights(model, dist.get_rank())
    writer = dist.get_rank() == 0 and topo.replica == _first_group(comm)
    if writer:
        torch.save(weights, run.root / "model.pt")
        if outer is not None:
            torch.save({k: v.cpu() for k, v in outer.items()}, run.root / "outer.pt")
    if cfg.elastic:  # each group's ranks; the launcher writes summary.json from every group's
        if dist.get_rank() == 0:
            run.groups.mkdir(exist_ok=True)
            write_json_atomic(run.group_record(topo.replica),
                              {"ranks": everyone, "ddp_one_step": _ddp_one_step(model, cfg),
                               "outer_sha256": _digest(outer), "model_sha256": _digest(weights)})
        dist.barrier()
        return None
    summary = summarize(cfg, everyone) if topo.rank == 0 else None
    if summary is not None:  # with the baseline's bytes for the same model and steps, computed
        add_ddp_bytes(summary, _ddp_one_step(model, cfg), cfg.replicas, tokens_per_step)
        write_json_atomic(run.summary, summary)
    dist.barrier()
    return summary


def set_up(cfg, topo, run, events, model, blocks, make_optimizer, broadcast: bool, meta: dict):
    """The link, the algorithm and the inner optimizer it builds with make_optimizer (after
    any sharding), config.json written: (comm, algorithm, optimizer). broadcast: a user's model
    starts from rank 0's weights. meta: config.json's own entries beside the measured ones.
    The trainer and lowband.Sync (sync/) set a run up here."""
    comm = Comm(topo, events, LinkOptions.build(cfg))
    comm.membership = membership(topo, cfg, comm)  # torchft's with --elastic, else fixed
    if broadcast:
        _broadcast_init(model, comm)
    algo = ALGORITHMS[cfg.algo]()
    optimizer = algo.setup(model, blocks, make_optimizer, topo, comm, cfg)
    comm.membership.register(algo)  # what a live group hands a joining one (base.heal_state)
    if dist.get_rank() == 0 and topo.replica == 0:  # the tokenizer goes to RUN/tokenizer/ for export
        write_json_atomic(run.config, {**cfg.to_dict(), "meta": {
            "world": topo.world, "n_params": num_params(model), "torch": torch.__version__,
            "device": topo.device.type, "backend": dist.get_backend(), **meta}})
    return comm, algo, optimizer


def start_training(cfg, topo, events, model, optimizer, algo, comm, resume_from, attempt,
                   extra_state=None) -> "Progress":
    """Where this process starts (a checkpoint's state loaded, its `run` event written, every
    rank together, the first quorum with --elastic): the progress so far. extra_state: a
    lowband.Sync user's objects (state_dict/load_state_dict) restored from the checkpoint."""
    done = Progress()
    if resume_from is not None:
        checkpoint.load(resume_from[0], model, optimizer, algo, topo.replica, resume_from[1])
        done = Progress(**resume_from[1]["progress"])
        comm.totals.restore(resume_from[1]["comm"])
        torch.set_rng_state(resume_from[1]["rng"])
        if extra_state:
            checkpoint.load_user_state(extra_state, resume_from[1]["user"])
    # one run event a rank: where this process starts (a resumed run continues the same files)
    events.emit("run", phase="start" if resume_from is None else "resume", world=topo.world,
                config_hash=cfg.hash(), step=done.step, **attempt)
    dist.barrier()  # every rank starts the clock together: set-up skew is not link time
    algo.join(done.step)  # --elastic: the first quorum; a group behind heals to a peer's step
    _take_heal(algo, done)
    return done


def _ddp_one_step(model, cfg) -> int:
    """What ddp would send over the outer link in one step of this model and layout."""
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    return ddp_outer_wire_bytes(sizes, cfg.replicas, cfg.shards, 1, cfg.bucket_mb)


def _digest(tensors: dict | None) -> str | None:
    """sha256 of a state's tensors' bytes, in key order: equal states, equal digests."""
    if tensors is None:
        return None
    h = hashlib.sha256()
    for key in sorted(tensors):
        h.update(key.encode())
        h.update(tensors[key].detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _take_heal(algo, done: "Progress") -> None:
    """--elastic: a group behind the others, healed from a live peer in a quorum, continues
    from that peer's step."""
    if algo.healed_step is not None:
        done.step, algo.healed_step = algo.healed_step, None


def _first_group(comm) -> int:
    """The replica group that writes model.pt: 0, or with --elastic the first of the last
    quorum (group 0 may be gone)."""
    members = comm.membership.members
    return min(members) if members else 0


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
    for micro in range(cfg.grad_accum):
        x, y = batches.train(step, micro)
        loss = lm_loss(model, x, y, cfg.precision) / cfg.grad_accum
        algo.before_backward(step, micro, micro == cfg.grad_accum - 1)
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
    return loss_sum.item(), cfg.grad_accum


def _skips_on_device(optimizer) -> bool:
    """Whether the optimizer's step can skip itself on the device: a fused AdamW reads
    `found_inf` as under a GradScaler and leaves parameters, moments and step counts as they
    were when it is 1 (plain tensors only: DTensor parameters take the host's decision)."""
    params = optimizer.param_groups[0]["params"]
    return bool(optimizer.defaults.get("fused")) and bool(params) and not is_dtensor(params[0])


class TrainingStopped(RuntimeError):
    """The run cannot go on; the message is one sentence naming what to do."""


@dataclass
class Progress:
    """What this rank has done so far; saved in checkpoints so totals span a resumed run."""
    step: int = 0
    tokens: int = 0
    compute_s: float = 0.0
    wall_s: float = 0.0
    loss: float = float("nan")
    val_loss: float = float("nan")
    # the evaluations every rank took: [step, val_loss, elapsed_s, tokens, outer_bytes], run-wide
    # (ledger.py), for summary.json's target
    evals: list = field(default_factory=list)

    def advance(self, loss: float, tokens: int, compute_s: float) -> None:
        self.step, self.loss = self.step + 1, loss
        self.tokens += tokens
        self.compute_s += compute_s


def _checkpoint(run, events, model, optimizer, algo, topo, comm, cfg, done, elapsed, faults,
                extra_state=None):
    def extra():
        out = {"progress": {**done.__dict__, "wall_s": elapsed}, "comm": comm.totals.state(),
               "rng": torch.get_rng_state(), "events_offset": run.event_file(topo.rank).stat().st_size}
        if extra_state:  # a lowband.Sync user's own objects (their state: plain data and tensors)
            out["user"] = checkpoint.user_state(extra_state)
        return out

    path = checkpoint.save(run, done.step, model, optimizer, algo, topo.replica, extra,
                           cfg.keep_checkpoints,
                           crash_before_rename=faults is not None and faults.crash_checkpoint == done.step,
                           group=lifecycle.group(cfg, topo))
    events.emit("checkpoint", step=done.step, path=str(path))


def _full_weights(model: nn.Module, rank: int) -> dict | None:
    """The model's weights as whole CPU tensors on rank 0 (None elsewhere). Every rank takes
    part: a sharded (FSDP2, DTensor) parameter is gathered over its replica's group."""
    out = {}
    for k, v in model.state_dict().items():
        if is_dtensor(v):
            v = v.full_tensor()
        if rank == 0:  # the model's own names: no torch.compile or DDP wrapper prefix
            out[_unwrapped(k)] = v.detach().cpu()
    return out if rank == 0 else None


def _unwrapped(key: str) -> str:
    for prefix in ("_orig_mod.", "module."):
        key = key.replace(prefix, "") if key.startswith(prefix) or f".{prefix}" in key else key
    return key


def _eval(algo, model, batches, cfg, events, step, done, elapsed, ledger, comm, everyone):
    """Evaluate after `step` steps, `elapsed` training seconds: the eval event says what
    reaching its loss took (ledger.py), done.val_loss keeps the loss."""
    outer = comm.totals.wire_bytes["outer"]  # sent before the evaluation, not during it
    with algo.eval_weights(cfg.eval_params):
        val_loss = evaluate(model, batches, cfg)
    record_eval(events, ledger, done, step, val_loss, elapsed, outer, everyone)


def record_eval(events, ledger, done, step, val_loss, elapsed, outer, everyone) -> None:
    """An evaluation's loss kept (done.val_loss), its event written with what reaching it took
    (ledger.py), and where every rank evaluated, its record for the target. The trainer's and
    lowband.Sync's evaluations (the user's own) are recorded here."""
    done.val_loss = val_loss
    fields, record = ledger.at_eval(step, val_loss, elapsed, done.tokens, outer, everyone)
    events.emit("eval", step=step, val_loss=val_loss, **fields)
    if record is not None:
        done.evals.append(record)


def _broadcast_init(model: nn.Module, comm: Comm) -> None:
    """A user's model starts from rank 0's initialisation on every rank: one flat transfer
    before training, recorded as a `setup` event (tag 'init'), not in the sync figures."""
    params = list(model.parameters())
    flat = flatten(params)
    comm.broadcast(flat, src=0, tag="init", setup=True).wait()
    write_flat(params, flat)
    comm.take_wait_s()


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
