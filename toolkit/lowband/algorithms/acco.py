"""acco (ACCO, arXiv 2406.02613): zero1's sharded optimizer with its communication hidden.

The sharding, the round (reduce-scatter -> mean over micro-batches -> global-norm clipping, with
--acco-clip only -> shard optimizer step -> all-gather) and the weighting of micro-batches are
zero1's (zero1.py).
What acco adds: each round runs on a background thread (with its own CUDA stream on GPU; that
path is written but has only been run on CPU so far) while the training thread keeps computing
and accumulating micro-batch gradients, and there are two rounds per step so that the
gradients computed during a round are not stale.

The schedule (as in the authors' code, edouardoyallon/acco trainer_decoupled.py: the rounds
alternate estimate / real, the state is restored after an estimate, the gradient buffer is
reset only after an estimate's results are taken). θ(t) are the parameters after t steps, θ̃(t)
their estimate, θ̃(0) = θ(0). Step t (0-based) of the trainer:

  phase 1   while R(t-1), the real round of step t-1, is in flight: compute group G1(t) of
            micro-batches at θ̃(t) (the model holds θ̃(t); step 0: nothing in flight, at θ(0))
  land      wait for R(t-1); the model takes θ(t)
  launch    E(t), the estimate:   θ̃(t+1) = Opt(θ(t), mean over G1(t))
            (same lr(t); the master shard, the moments and the step count are left untouched)
  phase 2   while E(t) is in flight: compute group G2(t) at θ(t), accumulated onto G1(t)
  land      wait for E(t); the model takes θ̃(t+1)
  launch    R(t), the real step:  θ(t+1) = Opt(θ(t), mean over G1(t) ∪ G2(t))   (state advances)
  return    R(t) stays in flight during phase 1 of step t+1

So of the two groups that make step t's update, the first was computed at the estimate θ̃(t)
(while the previous real round was on the wire) and the second at θ(t) itself (while the
estimate was on the wire); the estimate uses the first group only. (Seen from the rounds: what
is computed at θ̃(t+1) while R(t) is on the wire is the first group of step t+1.) Both rounds of
step t use lr(t). finish() lands the last real round (the model then holds θ(T)); between steps
the model holds θ̃(t+1), and evaluations swap in θ(t+1) (eval_weights waits for the round in
flight, without counting it as step time). --corrupt therefore perturbs θ̃(t+1), i.e. one group
of gradients, not the sharded master parameters.

Micro-batches per group (--acco-micro), within the budget below:
  adaptive  each rank computes micro-batches until the round in flight has completed, at least
            one per group: a fast rank contributes more than a slow one (--straggler), and
            nobody idles while the link is busy. Step 0's first group is one micro-batch.
            The budget's caps (below) are the only bound: on a very slow link the batch per
            update grows (and the steps get fewer).
  N1:N2     fixed: N1 micro-batches in group 1 and N2 in group 2 on every rank, or one N1:N2
            per rank, comma-separated (heterogeneous workers, for tests and experiments).
Counts travel with the gradients (zero1.py: one slot per reduce-scatter piece): a round's
gradient is the sum over ranks and micro-batches divided by the total count, so every
micro-batch weighs the same, whoever computed it.

Budget (as the authors' code, which stops on a global gradient count): the run ends when the
micro-batches computed over all ranks reach --steps x --grad-accum x world, exactly what ddp
computes, whatever the groups took per step; `steps_run` and `micro_batches_per_step` in the
summary say how many steps that made and how large they were. All ranks agree on it without a
transfer on the training thread (MicroBudget, acco_budget.py): they know each landed round's
counts per rank (fixed counts are known in advance; with adaptive counts each round starts with
a small all-gather of the ranks' counts, tags `count` and `est-count`, as the authors all-reduce
theirs apart from the gradients), and each group not yet landed has a known bound, the caps its
ranks computed under. Each group gets caps, one per rank, that fit in what is left after the landed
rounds and those bounds:
  adaptive  twice the ranks' counts in the last group of the same kind (group 1 or 2) plus
            one a rank, split in proportion to those counts (so a fast rank keeps its share
            and a group may double from one step to the next), and at most half of what is free
            (rounded up; the rest is left for the next group); the caps bind only near the end
            of the budget or when a group more than doubles
  N1:N2     the counts themselves, trimmed (largest first) where they do not fit: exact
An adaptive run's last step is decided as its group 2 starts (the previous real round has
landed): it is the last when what is left of the budget is at most 1.5 times the previous
step's micro-batches, or too little for two more groups. Its group 2 is capped at all that is
free while the estimate is on the wire; once the estimate has landed (its counts are then
known) each rank tops its group 2 up to its part of what is left, at θ(t), without overlap. So
the total is exact, and the last step may take more or fewer micro-batches than the others; a
rank whose cap is 0 computes nothing in that group.
The learning rate of step t (both rounds) is the schedule at the budget's progress:
lr_at(micro-batches landed before step t / (--grad-accum x world)), so the warm-up and the
cosine span the budget as they span ddp's --steps; the `step` events report that lr, and
the progress bar counts the budget's micro-batches in ddp's steps.
With --time-budget the budget above is the most micro-batches a run may take (as --steps is
every algorithm's most steps): the trainer's clock ends the run after the step at which the
time is spent (clock.py), the real round then in flight lands in finish(), and the learning
rate follows the later of the budget's progress and the time's (schedule.lr_at).

Clipping: none in the rounds, as in the authors' code; --acco-clip clips each round's (the
estimate's too) global gradient norm at --grad-clip, as zero1 does.

Time accounting: the trainer's compute time is the step minus the seconds the training thread
was blocked. Only the training thread's waits for a round count (added to comm.wait_s); the
round's own transfers go through a shallow copy of Comm (same link, totals, events and lock,
its own wait counter), so the background thread's waiting is not mistaken for the trainer's.
That copy runs its collectives on acco's own process group over all ranks (labelled "world",
outer/inner by ring position as usual): collectives of the training thread — a checkpoint's
barrier while a round is in flight — go through the default group and cannot be interleaved
with the round's in a different order on different ranks.

Checkpoints: state_dict() waits for the round in flight and stores its result (θ(t+1)) with
its count, the shard optimizer, the counter, the budget and the skips; with fixed counts a
resumed run continues bitwise identically (adaptive counts depend on timing, so a resumed
adaptive run is equally valid but not the same).
"""

from __future__ import annotations

import contextlib
import copy
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lowband.algorithms.acco_budget import MicroBudget
from lowband.algorithms.zero1 import ShardOptions, ZeRO1
from lowband.comm.sends import Schedule, chained
from lowband.comm.wire import wire_bytes
from lowband.models import lm_loss
from lowband.options import ConfigError, Options, option


def parse_micro(text: str, world: int) -> list[tuple[int, int]] | None:
    """--acco-micro: None for adaptive, else (N1, N2) for every rank."""
    if text == "adaptive":
        return None
    entries = text.split(",")
    try:
        counts = [tuple(int(v) for v in e.split(":")) for e in entries]
        if any(len(c) != 2 or min(c) < 1 for c in counts):
            raise ValueError
    except ValueError:
        raise ConfigError(f"cannot read --acco-micro '{text}': write 'adaptive', N1:N2 with "
                          "positive counts (e.g. 2:2), or one N1:N2 per rank separated by "
                          "commas.") from None
    if len(counts) not in (1, world):
        raise ConfigError(f"--acco-micro '{text}' gives {len(counts)} counts for {world} ranks: "
                          "give one N1:N2 for all ranks or one per rank.")
    return counts * world if len(counts) == 1 else counts


@dataclass
class AccoOptions(Options):
    title = "acco"
    acco_micro: str = option("adaptive", "micro-batches per group: adaptive (as many as fit while "
                             "the round is in flight, at least 1), N1:N2 (fixed, every rank) or "
                             "one N1:N2 per rank, comma-separated")
    acco_clip: bool = option(False, "clip each round's global gradient norm at --grad-clip (the "
                             "authors' rounds do not clip)")

    @classmethod
    def check(cls, cfg) -> None:
        parse_micro(cfg.acco_micro, cfg.world)


class _Replaced:
    """An object with some attributes replaced: acco's config for zero1's round, whose
    clipping reads grad_clip (0 unless --acco-clip)."""

    def __init__(self, base, **values):
        self._base = base
        self.__dict__.update(values)

    def __getattr__(self, name):
        return getattr(self._base, name)


class _OwnWorld:
    """The topology, with "world" meaning acco's own process group over every rank."""

    def __init__(self, topology, group):
        self._topology, self._group = topology, group

    def __getattr__(self, name):
        return getattr(self._topology, name)

    def group(self, name: str):
        return self._group if name == "world" else self._topology.group(name)


def _done(value) -> Future:
    f = Future()
    f.set_result(value)
    return f


class ACCO(ZeRO1):
    name = "acco"
    own_loop_why = ("it owns the inner step (micro-batches keep accumulating while its round is in "
                    "flight, then its own AdamW on flat shards), so it cannot follow your "
                    "optimizer's step")
    options = (ShardOptions, AccoOptions)
    summary = ("ACCO: zero1 whose communication hides behind accumulation, estimate and real "
               "rounds")
    loss_fit = None  # its estimate rounds change the updates: no figure here

    @classmethod
    def outer_link(cls, run):
        """--acco-rounds rounds a step (lowband's: two, the estimate and the real one), each
        zero1's round (with adaptive micro-batches first the counts' all-gather) on the
        background thread, released at the end of its share of a step and waited for at the
        end of the next round's share."""
        u = run.step_time / run.acco_rounds
        counts = [wire_bytes("all_gather", 4, run.world)] if run.acco_adaptive else []
        return Schedule(u, run.acco_rounds, 1, (0,), (chained(counts + cls.round_bytes(run), 2, u),))

    def setup(self, model, blocks, make_optimizer, topology, comm, config):
        optimizer = super().setup(model, blocks, make_optimizer, topology, comm, config)
        counts = parse_micro(config.acco_micro, topology.world)
        self.adaptive = counts is None
        self.budget = MicroBudget(config.steps * config.grad_accum * topology.world,
                                  topology.world, counts)
        self.config = _Replaced(config, grad_clip=config.grad_clip if config.acco_clip else 0.0)
        self.counter = 0  # running micro-batch number of this rank
        self.step, self.loss = 0, float("nan")  # the last step taken, its loss
        self.pending: Future | None = None  # the round in flight (or landed, not yet taken)
        self.pending_kind = None  # "estimate" or "real"
        # the rounds' transfers: same link, totals and events, but their own wait counter and
        # their own process group over the world, so that a collective the training thread
        # makes meanwhile (a checkpoint's barrier) cannot interleave with them differently
        # on different ranks
        self.round_comm = copy.copy(comm)
        group = dist.new_group(list(range(topology.world)))
        dist.barrier(group=group)  # its connections made now: the first round is not slower
        self.round_comm.topo = _OwnWorld(topology, group)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="acco-round")
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        return optimizer

    # -- the background round -----------------------------------------------------------------

    def _launch(self, lr: float, commit: bool, count: int) -> None:
        self.layout.fill_send(self.send, count)
        ready = None
        if self.stream is not None:  # the side stream starts after the gradients are in place
            ready = torch.cuda.Event()
            ready.record()
        self.pending = self.pool.submit(self._background, lr, commit, count, ready)
        self.pending_kind = "real" if commit else "estimate"

    def _background(self, lr: float, commit: bool, count: int, ready):
        if self.stream is None:
            return self._counted_round(lr, commit, count)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            out = self._counted_round(lr, commit, count)
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()  # done() on the future means the parameters are there
        return out

    def _counted_round(self, lr: float, commit: bool, count: int):
        """zero1's round; with adaptive counts first an all-gather of every rank's count (the
        budget's caps follow the ranks' speeds). Returns (parameters, skipped, counts or None)."""
        prefix = "" if commit else "est-"
        counts = None
        if self.adaptive:
            mine = torch.tensor([float(count)], device=self.device)
            parts = self.round_comm.all_gather(mine, "world", tag=prefix + "count").wait()
            counts = [int(p.item()) for p in parts]
        full, skipped = self._round(self.round_comm, lr, commit, prefix)
        return full, bool(skipped), counts  # (this thread waits for the round here)

    def _land(self, count_wait: bool = True):
        """Wait for the round in flight; returns (kind, full parameters, skipped, counts per rank
        or None) or None."""
        if self.pending is None:
            return None
        t0 = time.perf_counter()
        full, skipped, counts = self.pending.result()
        if count_wait:
            self.comm.wait_s += time.perf_counter() - t0
        if self.stream is not None:
            full.record_stream(torch.cuda.current_stream(self.device))
        kind, self.pending, self.pending_kind = self.pending_kind, None, None
        return kind, full, skipped, counts

    # -- the step -----------------------------------------------------------------------------

    def _accumulate(self, batches, cap: int, adaptive: bool) -> tuple[torch.Tensor, int]:
        """Backpropagate micro-batches, unscaled, into the model's gradients: `cap` of them, or
        (adaptive) until the round in flight is done, at least one, at most `cap`."""
        loss_sum, n = torch.zeros((), device=self.device), 0
        A = self.config.grad_accum
        while n < cap:
            x, y = batches.train(self.counter // A, self.counter % A)
            self.counter += 1
            loss = lm_loss(self.model, x, y, self.config.precision)
            loss.backward()
            loss_sum += loss.detach()
            n += 1
            if adaptive:
                if self.stream is not None:  # the question is whether the GPU kept up
                    torch.cuda.current_stream(self.device).synchronize()
                if self.pending is None or self.pending.done():
                    break
        return loss_sum, n

    def train_step(self, step, batches, lr):
        """One step; `lr` (the trainer's, by step number) gives way to the budget's progress."""
        budget, me = self.budget, self.topo.rank
        loss1, n1 = self._accumulate(batches, budget.first(step)[me], self.adaptive)  # G1(t), θ̃(t)
        landed = self._land()
        if landed is not None:  # R(t-1): θ(t)
            _, theta, skipped, counts = landed
            self.layout.write(theta)
            self._note_skip(skipped, step - 1)
            budget.real_landed(counts)
        lr = self.lr(step)
        self._launch(lr, commit=False, count=n1)  # E(t) from G1(t)
        caps, last = budget.second()
        loss2, n2 = self._accumulate(batches, caps[me], self.adaptive)  # G2(t) at θ(t), onto G1(t)
        _, estimate, _, counts = self._land()
        budget.estimate_landed(counts)
        if last:  # the budget's last step: G2(t) topped up to this rank's share of what is left
            more, k = self._accumulate(batches, budget.top_up()[me] - n2, adaptive=False)
            loss2, n2 = loss2 + more, n2 + k
        self.layout.write(estimate)  # θ̃(t+1)
        self._launch(lr, commit=True, count=n1 + n2)  # R(t) from G1(t) ∪ G2(t)
        self.model.zero_grad(set_to_none=True)
        n = n1 + n2
        if n:  # a rank left without micro-batches at the end reports its previous loss
            self.loss = (loss1 + loss2).item() / n
        self.step = step
        return self.loss, n

    def should_stop(self, step: int) -> bool:
        return self.budget.spent()

    def lr_step(self, step: int) -> float:
        """The budget's progress once R(t-1) has landed; R(t) lands in the next step, so until
        then it is what step t's rounds read."""
        return self.budget.progress(self.config.grad_accum)

    def progress_steps(self, step: int) -> float:
        """The micro-batches computed so far (landed or in flight), in ddp's steps."""
        b = self.budget
        return (b.total - b.free()) / (self.config.grad_accum * self.topo.world)

    def ends_after(self, step: int) -> bool:
        return self.budget.spent()

    # -- the trainer's other hooks -------------------------------------------------------------

    def _drain(self):
        """Wait for the round in flight (not step time) and keep its result for the next step."""
        landed = self._land(count_wait=False)
        if landed is not None:
            self.pending, self.pending_kind = _done(landed[1:]), landed[0]
        return landed

    def finish(self) -> None:
        landed = self._land(count_wait=False)
        if landed is not None:
            _, theta, skipped, counts = landed
            self.layout.write(theta)  # θ(T)
            self._note_skip(skipped, self.step)
            self.budget.real_landed(counts)

    @contextlib.contextmanager
    def eval_weights(self, which: str):
        landed = self._drain()
        if landed is None:  # nothing in flight: the model holds θ
            yield
            return
        saved = self.layout.flat()
        self.layout.write(landed[1])
        try:
            yield
        finally:
            self.layout.write(saved)

    def state_dict(self) -> dict:
        landed = self._drain()
        state = super().state_dict()
        state.update(counter=self.counter, budget=self.budget.state_dict(), step=self.step,
                     loss=self.loss, landed=None if landed is None else
                     (landed[0], landed[1].detach().cpu().clone(), *landed[2:]))
        return state

    def load_state_dict(self, state: dict) -> None:
        if "budget" not in state:
            raise ConfigError("this checkpoint's acco state was written before acco counted its "
                              "budget in micro-batches: resume it with the lowband that wrote it, "
                              "or start the run again.")
        super().load_state_dict(state)
        self.counter, self.step, self.loss = state["counter"], state["step"], state["loss"]
        self.budget.load_state_dict(state["budget"])
        self.pending = self.pending_kind = None
        if state["landed"] is not None:
            kind, full, skipped, counts = state["landed"]
            self.pending, self.pending_kind = _done((full.to(self.device), skipped, counts)), kind
