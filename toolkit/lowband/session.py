"""A run in progress: one Session that every training loop drives.

`lowband train` (train.py), a user's own loop (`lowband.Sync`, sync/) and the Hugging Face
Trainer (through Sync) each step the model their own way; what a run *is* lives here once: the
config, the topology, the run directory and its events, the link (comm), the algorithm and the
inner optimizer it built, the training clock, the evaluation ledger and the progress so far.
A loop calls, in order:

    session = Session(cfg, topo, resume)          the run directory (claimed or resumed), events
    session.set_up(model, blocks, make_optimizer)  comm, membership, algorithm, config.json
    session.begin()                                a checkpoint loaded, the `run` event, the
                                                   first quorum; the clock starts
    per step: the algorithm's hooks around the loop's own step (algorithms/base.py), then
    session.stepped(loss, tokens, step_s, lr)      the progress and the step's event
    session.evaluated(val_loss)                    an evaluation's event and record
    session.maybe_checkpoint(step, last)           the checkpoint rule (--checkpoint-every)
    session.finish(evaluate)                       exchanges land, the final evaluation,
                                                   model.pt, outer.pt and summary.json

state_dict()/load_state_dict() are what a checkpoint keeps beside the model, the optimizer and
the algorithm's state: the progress, the byte totals, the RNG, the user's own objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from lowband import checkpoint, summary as summaries
from lowband.algorithms import ALGORITHMS
from lowband.algorithms.ddp import outer_wire_bytes as ddp_outer_wire_bytes
from lowband.checkpoint import lifecycle
from lowband.clock import RunClock
from lowband.comm import Comm
from lowband.comm.link import LinkOptions
from lowband.comm.membership.elastic import membership
from lowband.config import Config
from lowband.ledger import Ledger
from lowband.models import num_params
from lowband.params import digest, flatten, is_dtensor, write_flat
from lowband.telemetry import EventWriter, atomic_path, write_json_atomic


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


class Session:
    """One run in progress on this rank (module doc). faults: `lowband train`'s injected
    faults (faults.py; None in a user's loop); user_state: a lowband.Sync user's own objects
    (state_dict/load_state_dict), checkpointed and handed over in a heal with the model."""

    def __init__(self, cfg: Config, topo, resume: bool = False, *, faults=None,
                 user_state: dict | None = None):
        start = lifecycle.begin(cfg, topo, resume)  # the run directory, a resume point, attempt
        self.cfg, self.topo, self.run, self._start = cfg, topo, start.run, start
        self.events = EventWriter(start.run, topo.rank, topo.replica)
        self.faults, self.user_state = faults, user_state or {}
        self.progress = Progress()
        self.comm = self.algo = self.optimizer = self.ledger = self.clock = None
        self.model = None
        self.vocab = None  # the tokens' vocabulary where known (summary.py: diverged)

    # -- before the loop ---------------------------------------------------------------------

    def set_up(self, model: nn.Module, blocks: nn.ModuleList, make_optimizer, *,
               broadcast: bool, meta: dict) -> torch.optim.Optimizer:
        """The link, the membership, the algorithm and the inner optimizer it builds with
        make_optimizer (after any sharding), config.json written. broadcast: a user's model
        starts from rank 0's weights. meta: config.json's own entries beside the measured
        ones. Returns the inner optimizer."""
        cfg, topo = self.cfg, self.topo
        self.model = model
        self.comm = comm = Comm(topo, self.events, LinkOptions.build(cfg))
        comm.membership = membership(topo, cfg, comm)  # torchft's with --elastic, else fixed
        if broadcast:
            _broadcast_init(model, comm)
        self.algo = algo = ALGORITHMS[cfg.algo]()
        algo.faults = self.faults
        self.optimizer = algo.setup(model, blocks, make_optimizer, topo, comm, cfg)
        comm.membership.register(algo)  # what a live group hands a joining one (base.heal_state)
        if self.user_state:  # the user's objects go with it
            comm.membership.hand_over("user",
                                      lambda got: checkpoint.load_user_state(self.user_state, got),
                                      lambda: checkpoint.user_state(self.user_state))
        if dist.get_rank() == 0 and topo.replica == 0:
            write_json_atomic(self.run.config, {**cfg.to_dict(), "meta": {
                "world": topo.world, "n_params": num_params(model), "torch": torch.__version__,
                "device": topo.device.type, "backend": dist.get_backend(), **meta,
                **({"link": cfg.measured_link} if cfg.measured_link else {})}})
        self.ledger = Ledger(topo.shards, cfg.elastic)
        return self.optimizer

    def begin(self, time_budget: float | None = None) -> Progress:
        """Where this process starts (a checkpoint's state loaded, its `run` event written,
        every rank together, the first quorum with --elastic), and the training clock started
        (time_budget: --time-budget's seconds, which rank 0's clock decides for every rank).
        Returns the progress so far."""
        resume_from = self._start.resume_from
        if resume_from is not None:
            checkpoint.load(resume_from[0], self.model, self.optimizer, self.algo,
                            self.topo.replica, resume_from[1])
            self.load_state_dict(resume_from[1])
        # one run event a rank: where this process starts (a resumed run continues its files)
        self.events.emit_run("start" if resume_from is None else "resume", self.topo.world,
                             self.cfg.hash(), step=self.progress.step, **self._start.attempt)
        dist.barrier()  # every rank starts the clock together: set-up skew is not link time
        self.algo.join(self.progress.step)  # --elastic: the first quorum; a group behind heals
        self.take_heal()
        self.clock = self.algo.clock = RunClock(time_budget, self.progress.wall_s,
                                                self.topo.device)
        return self.progress

    # -- each step ---------------------------------------------------------------------------

    def take_heal(self) -> None:
        """--elastic: a group behind the others, healed from a live peer in a quorum, goes on
        from that peer's step."""
        if self.algo.healed_step is not None:
            self.progress.step, self.algo.healed_step = self.algo.healed_step, None

    def stepped(self, loss: float, tokens: int, step_s: float, lr: float) -> float:
        """A step taken (after the algorithm's after_step): its time less the link's waits is
        compute, the progress advances (a heal taken in it moves it to the peer's step), and
        the step's event is written. Returns the training seconds so far."""
        step = self.progress.step
        compute_s = max(step_s - self.comm.take_wait_s(), 0.0)
        self.progress.advance(loss, tokens, compute_s)
        self.algo.compute_s += compute_s
        self.algo.computed_steps += 1
        self.take_heal()
        elapsed = self.clock.seconds()
        self.events.emit_step(step + 1, loss, lr, self.progress.tokens, step_s, compute_s, elapsed)
        return elapsed

    def evaluated(self, val_loss: float, elapsed: float | None = None,
                  outer_bytes: int | None = None, everyone: bool = True,
                  step: int | None = None) -> None:
        """An evaluation: its loss kept, its event written with what reaching it took
        (ledger.py: run-wide seconds, tokens, outer bytes), and where every rank evaluated
        (`everyone`), its record for summary.json's target. elapsed: the training seconds it
        is after (default now); outer_bytes: the outer link's bytes sent before it (default
        now); step: the steps it is after (default the steps done; the trainer's loop names
        the step it took, which a heal in it may have moved the progress past)."""
        elapsed = self.clock.seconds() if elapsed is None else elapsed
        outer = self.comm.totals.wire_bytes["outer"] if outer_bytes is None else outer_bytes
        done = self.progress
        step = self.run_step() if step is None else step
        done.val_loss = val_loss
        fields, record = self.ledger.at_eval(step, val_loss, elapsed, done.tokens, outer,
                                             everyone)
        self.events.emit_eval(step, val_loss, **fields)
        if record is not None:
            done.evals.append(record)
            self.algo.evaluated(step, record[1])  # (--rollback)

    def run_step(self) -> int:
        """Where the steps done stand on the run's schedule (algorithms/base.py run_step: the
        steps done, or with --local-steps adaptive the run step of the last sync started)."""
        at = self.algo.run_step(self.progress.step)
        return self.progress.step if at is None else at

    def evaluate(self, val_loss_of, elapsed: float | None = None, everyone: bool = True,
                 step: int | None = None) -> None:
        """An evaluation this rank takes now: val_loss_of() (None: none), recorded as
        evaluated() records it, with the outer link's bytes counted before it (it sends none)."""
        outer = self.comm.totals.wire_bytes["outer"]
        val_loss = val_loss_of()
        if val_loss is not None:
            self.evaluated(val_loss, elapsed, outer, everyone, step)

    def maybe_checkpoint(self, step: int, last: bool, now: bool = False) -> None:
        """The checkpoint rule, after inner step `step` (1-based; last: the run's last step):
        every --checkpoint-every steps of the run's schedule and at the end; `now`: here in
        any case (a run a signal stopped: checkpoint/preempt.py)."""
        every, at = self.cfg.checkpoint_every, self.algo.run_step(step)
        if now or every and (last or at is not None and at % every == 0):
            self.checkpoint()

    def checkpoint(self) -> None:
        """Write a checkpoint now (every rank, after the same step): the model, the optimizer,
        the algorithm's state and this session's (state_dict), through torch DCP."""
        at = self.run_step()  # (every replica's the same, also where their steps differ)
        crash = self.faults is not None and self.faults.crash_checkpoint == at
        path = checkpoint.save(self.run, at, self.model, self.optimizer, self.algo,
                               self.topo.replica, self.state_dict, self.cfg.keep_checkpoints,
                               crash_before_rename=crash,
                               group=lifecycle.group(self.cfg, self.topo))
        self.events.emit_checkpoint(at, str(path))

    def state_dict(self) -> dict:
        """This rank's state beside the model's, the optimizer's and the algorithm's: the
        progress (training seconds so far), the byte totals, the RNG, the size of its event
        file (a resume drops what came after), the user's objects."""
        out = {"progress": {**self.progress.__dict__, "wall_s": self.clock.seconds()},
               "comm": self.comm.totals.state(), "rng": torch.get_rng_state(),
               "events_offset": self.run.event_file(self.topo.rank).stat().st_size}
        if self.user_state:  # a lowband.Sync user's own objects: plain data and tensors
            out["user"] = checkpoint.user_state(self.user_state)
        return out

    def load_state_dict(self, state: dict) -> None:
        self.progress = Progress(**state["progress"])
        self.comm.totals.restore(state["comm"])
        torch.set_rng_state(state["rng"])
        if self.user_state:
            checkpoint.load_user_state(self.user_state, state["user"])

    # -- the end -----------------------------------------------------------------------------

    def finish(self, evaluate=None, tokens_per_step: int | None = None) -> dict | None:
        """The end of the run (every rank): exchanges in flight land, the training clock stops,
        the final evaluation (evaluate(): its loss, with the outer bytes sent before it; None:
        none), then the `run` end event, model.pt and outer.pt, and summary.json (--elastic:
        the group's record the launcher sums). tokens_per_step: ddp's tokens a step over all
        ranks, for the ddp bytes the summary compares with (None: from the steps run). Returns
        the summary on rank 0 of a non-elastic run."""
        self.algo.finish()
        self.progress.wall_s = self.clock.seconds()  # training time only (a resume's included)
        if evaluate is not None:
            self.evaluate(evaluate, self.progress.wall_s)
        return self._write_results(tokens_per_step)

    def close(self) -> None:
        self.events.close()

    def _write_results(self, tokens_per_step: int | None) -> dict | None:
        cfg, topo, comm, done = self.cfg, self.topo, self.comm, self.progress
        outer = self.algo.outer_params()
        self.events.emit_run("end", topo.world, cfg.hash())
        totals = comm.totals
        mine = {"tokens": done.tokens, "steps": done.step, "wall_s": done.wall_s,
                "compute_s": done.compute_s, "loss": done.loss, "val_loss": done.val_loss,
                "replica": topo.replica, "shard": topo.shard, "evals": done.evals,
                "outer_wire": totals.wire_bytes["outer"], "inner_wire": totals.wire_bytes["inner"],
                "peak_outer": totals.peak_outer_payload, "setup_wire": totals.setup_wire_bytes,
                "outer_sha256": digest(outer)}
        if self.vocab:
            mine["vocab"] = self.vocab
        guard = getattr(self.algo, "guard", None)
        if guard is not None and (guard.on or guard.records):  # summary.json's left_out
            mine["guard"], mine["guard_s"] = guard.records, guard.seconds
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        weights = _full_weights(self.model, dist.get_rank())
        if dist.get_rank() == 0 and topo.replica == self._first_group():
            # whole or not at all: a full disk leaves no truncated model.pt (telemetry.atomic_path)
            with atomic_path(self.run.root / "model.pt") as tmp, open(tmp, "wb") as f:
                torch.save(weights, f)
            if outer is not None:
                with atomic_path(self.run.root / "outer.pt") as tmp, open(tmp, "wb") as f:
                    torch.save({k: v.cpu() for k, v in outer.items()}, f)
        one_step = _ddp_one_step(self.model, cfg)
        if cfg.elastic:  # each group's ranks; the launcher writes summary.json from every group's
            if dist.get_rank() == 0:
                summaries.write_group_record(self.run, topo.replica, everyone, one_step,
                                             digest(outer), digest(weights))
            dist.barrier()
            return None
        summary = None
        if topo.rank == 0:  # with the baseline's bytes for the same model and steps, computed
            summary = summaries.write_plain(cfg, self.run, everyone, one_step, tokens_per_step)
        dist.barrier()
        return summary

    def _first_group(self) -> int:
        """The replica group that writes model.pt: 0, or with --elastic the first of the last
        quorum (group 0 may be gone)."""
        members = self.comm.membership.members
        return min(members) if members else 0


def _ddp_one_step(model, cfg) -> int:
    """What ddp would send over the outer link in one step of this model and layout."""
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    return ddp_outer_wire_bytes(sizes, cfg.replicas, cfg.shards, 1, cfg.bucket_mb)


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


def _broadcast_init(model: nn.Module, comm: Comm) -> None:
    """A user's model starts from rank 0's initialisation on every rank: one flat transfer
    before training, recorded as a `setup` event (tag 'init'), not in the sync figures."""
    params = list(model.parameters())
    flat = flatten(params)
    comm.broadcast(flat, src=0, tag="init", setup=True).wait()
    write_flat(params, flat)
    comm.take_wait_s()
