"""acco (ACCO, arXiv 2406.02613): zero1's sharded optimizer with its communication hidden.

The sharding, the round (reduce-scatter -> mean over micro-batches -> global-norm clipping ->
shard optimizer step -> all-gather) and the weighting of micro-batches are zero1's (zero1.py).
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

Micro-batches per group (--acco-micro):
  adaptive  each rank computes micro-batches until the round in flight has completed, at least
            one per group: a fast rank contributes more than a slow one (--straggler), and
            nobody idles while the link is busy. Step 0's first group is one micro-batch.
            There is no upper bound: on a very slow link the batch per update grows.
  N1:N2     fixed: N1 micro-batches in group 1 and N2 in group 2 on every rank, or one N1:N2
            per rank, comma-separated (heterogeneous workers, for tests and experiments).
Counts travel with the gradients (zero1.py: one slot per reduce-scatter piece): a round's
gradient is the sum over ranks and micro-batches divided by the total count, so every
micro-batch weighs the same, whoever computed it.

Batches: with a variable number of micro-batches per step, each rank numbers its micro-batches
with a running counter k = 0, 1, 2, ... (saved in checkpoints) and micro-batch k is
batches.train(k // A, k % A), A = --grad-accum: no batch is used twice, and with fixed counts
N1 + N2 = A acco trains on exactly ddp's batches (step t: batches.train(t, 0 .. A-1)).

Time accounting: the trainer's compute time is the step minus the seconds the training thread
was blocked. Only the training thread's waits for a round count (added to comm.wait_s); the
round's own transfers go through a shallow copy of Comm (same link, totals, events and lock,
its own wait counter), so the background thread's waiting is not mistaken for the trainer's.
That copy runs its collectives on acco's own process group over all ranks (labelled "world",
outer/inner by ring position as usual): collectives of the training thread — a checkpoint's
barrier while a round is in flight — go through the default group and cannot be interleaved
with the round's in a different order on different ranks.

Checkpoints: state_dict() waits for the round in flight and stores its result (θ(t+1)), the
shard optimizer, the counter and the skips; with fixed counts a resumed run continues bitwise
identically (adaptive counts depend on timing, so a resumed adaptive run is equally valid but
not the same).
"""

from __future__ import annotations

import contextlib
import copy
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lowband.algorithms.zero1 import ShardOptions, ZeRO1
from lowband.model import lm_loss
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

    @classmethod
    def check(cls, cfg) -> None:
        parse_micro(cfg.acco_micro, cfg.world)


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
    options = (ShardOptions, AccoOptions)
    summary = ("ACCO: zero1 whose communication hides behind accumulation, estimate and real "
               "rounds")

    def setup(self, model, blocks, make_optimizer, topology, comm, config):
        optimizer = super().setup(model, blocks, make_optimizer, topology, comm, config)
        counts = parse_micro(config.acco_micro, topology.world)
        self.fixed = None if counts is None else counts[topology.rank]
        self.counter = 0  # running micro-batch number of this rank
        self.pending: Future | None = None  # the round in flight (or landed, not yet taken)
        self.pending_kind = None  # "estimate" or "real"
        # the rounds' transfers: same link, totals and events, but their own wait counter and
        # their own process group over the world, so that a collective the training thread
        # makes meanwhile (a checkpoint's barrier) cannot interleave with them differently
        # on different ranks
        self.round_comm = copy.copy(comm)
        self.round_comm.topo = _OwnWorld(topology, dist.new_group(list(range(topology.world))))
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
        self.pending = self.pool.submit(self._background, lr, commit, ready)
        self.pending_kind = "real" if commit else "estimate"

    def _background(self, lr: float, commit: bool, ready):
        prefix = "" if commit else "est-"
        if self.stream is None:
            return self._round(self.round_comm, lr, commit, prefix)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            out = self._round(self.round_comm, lr, commit, prefix)
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()  # done() on the future means the parameters are there
        return out

    def _land(self, count_wait: bool = True):
        """Wait for the round in flight; returns (kind, full parameters, skipped) or None."""
        if self.pending is None:
            return None
        t0 = time.perf_counter()
        full, skipped = self.pending.result()
        if count_wait:
            self.comm.wait_s += time.perf_counter() - t0
        if self.stream is not None:
            full.record_stream(torch.cuda.current_stream(self.device))
        kind, self.pending, self.pending_kind = self.pending_kind, None, None
        return kind, full, skipped

    # -- the step -----------------------------------------------------------------------------

    def _accumulate(self, batches, target: int | None) -> tuple[torch.Tensor, int]:
        """Backpropagate micro-batches, unscaled, into the model's gradients: `target` of them,
        or (adaptive) until the round in flight is done, at least one."""
        loss_sum, n = torch.zeros((), device=self.device), 0
        A = self.config.grad_accum
        while True:
            x, y = batches.train(self.counter // A, self.counter % A)
            self.counter += 1
            loss = lm_loss(self.model, x, y, self.config.precision)
            loss.backward()
            loss_sum += loss.detach()
            n += 1
            if target is not None:
                if n >= target:
                    break
            else:
                if self.stream is not None:  # the question is whether the GPU kept up
                    torch.cuda.current_stream(self.device).synchronize()
                if self.pending is None or self.pending.done():
                    break
        return loss_sum, n

    def train_step(self, step, batches, lr):
        n1_target, n2_target = self.fixed if self.fixed else (None, None)
        loss1, n1 = self._accumulate(batches, n1_target)  # G1(t) at θ̃(t)
        landed = self._land()
        if landed is not None:  # R(t-1): θ(t)
            _, theta, skipped = landed
            self.layout.write(theta)
            self._note_skip(skipped, step - 1)
        self._launch(lr, commit=False, count=n1)  # E(t) from G1(t)
        loss2, n2 = self._accumulate(batches, n2_target)  # G2(t) at θ(t), onto G1(t)
        _, estimate, _ = self._land()
        self.layout.write(estimate)  # θ̃(t+1)
        self._launch(lr, commit=True, count=n1 + n2)  # R(t) from G1(t) ∪ G2(t)
        self.model.zero_grad(set_to_none=True)
        n = n1 + n2
        return (loss1 + loss2).item() / n, n

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
            _, theta, skipped = landed
            self.layout.write(theta)  # θ(T)
            self._note_skip(skipped, self.config.steps - 1)

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
        state.update(counter=self.counter, landed=None if landed is None else
                     (landed[0], landed[1].detach().cpu().clone(), landed[2]))
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.counter = state["counter"]
        self.pending = self.pending_kind = None
        if state["landed"] is not None:
            kind, full, skipped = state["landed"]
            self.pending, self.pending_kind = _done((full.to(self.device), skipped)), kind
