"""diloco and streaming (Streaming DiLoCo, arXiv 2501.18512): one implementation.

Each replica trains on its own with the inner AdamW (whose state is never synced). The model's
blocks are split into P fragments (params.split_fragments). Fragment p starts a sync after
inner step s whenever s is a multiple of H/P and (s / (H/P) - 1) mod P == p: so fragment 0
syncs at H/P, H/P + H, ..., fragment P-1 at H, 2H, ...; some fragment syncs every H/P steps,
each one every H steps. A sync of fragment p:
  start (after step s)     delta = theta_outer_p - theta_p, averaged over the replicas
                           through the outer link in the codec, asynchronously
  apply (after step s+tau) m = mu m + delta;  theta_outer_p -= lr (delta + mu m)   (Nesterov)
                           theta_p <- alpha theta_p + (1 - alpha) theta_outer_p
With P=1, tau=0, alpha=0 and fp32 this is DiLoCo. --outer-update eager (tau >= 1, eager.py):
the outer step at the start, with this replica's own share and the others' of the last sync.

With S > 1 ranks per replica, the replica is data-parallel inside (gradients averaged over the
inner group by ddp's buckets) and the outer work is split: shard k of the replica owns slice k
of each fragment's flat vector, keeps the outer parameters and momentum of that slice only,
averages it over the outer group (the ranks holding slice k in the other replicas), and the
merged slices are all-gathered over the inner group.

Error feedback (--error-feedback, on by default; nothing to do for fp32): what quantization
drops from a replica's pseudo-gradient is kept and added to that fragment's next one, so the
rounding errors do not accumulate as bias in the outer momentum.

--outer-rule sparseloco (SparseLoCo, arXiv 2508.15706, with a topk codec): the error feedback
is the momentum, kept per replica: e = beta e + delta (beta = --outer-momentum) is sent in the
codec, e keeps e - sent, and the outer step is plain SGD, theta_outer_p -= lr mean(sent).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowband.algorithms.base import AT_STEP_EDGES, Algorithm, PERIODIC
from lowband.algorithms.ddp import DDP
from lowband.algorithms.eager import Eager, EagerOptions
from lowband.algorithms.outer import (OuterOptions, Staging, nesterov_step, outer_home,
                                      outer_momentum_at, settle, sgd_step)
from lowband.algorithms.exchange import ExchangeOptions, exchange_block
from lowband.algorithms.fragments import Fragment, Fragmented
from lowband.algorithms.grace import Graced
from lowband.algorithms.guard import Guard, GuardOptions, Guarding, Verdict
from lowband.algorithms.pace import Pace, Paced, PaceOptions
from lowband.comm.membership.elastic import lineage_tiebreak
from lowband.comm.exchanges import Landed
from lowband.comm.sends import Schedule, average
from lowband.options import ConfigError, Options, option
from lowband.params import split_fragments, write_flat


@dataclass
class StreamingOptions(Options):
    title = "fragments"
    fragments: int = option(None, "P: fragments synced in turn (diloco 1, streaming 4, or the "
                            "model's blocks where it has fewer)", kind=int)
    fragment_pattern: str = option("strided", "strided (block i -> fragment i mod P) or "
                                   "sequential", ("strided", "sequential"))
    overlap: int = option(None, "tau: steps between starting a fragment's exchange and applying "
                          "it (diloco 0, streaming 1)", kind=int)
    alpha: float = option(None, "merge theta <- alpha*local + (1-alpha)*outer (diloco 0, "
                          "streaming 0.5)", kind=float)

    @classmethod
    def check(cls, cfg) -> None:
        P, H = cfg.fragments, cfg.sync_every
        if P <= 0:
            raise ConfigError("--sync-every and --fragments must be positive integers.")
        if H % P:
            raise ConfigError(f"--sync-every {H} is not a multiple of --fragments {P}: fragments "
                              "sync in turn every H/P steps, so pick H divisible by P.")
        if P > cfg.n_blocks():
            raise ConfigError(f"--fragments {P} is more than the model's {cfg.n_blocks()} blocks: "
                              "use at most one fragment per block.")
        if not 0 <= cfg.overlap < H // P:
            raise ConfigError(f"--overlap {cfg.overlap} must be at least 0 and below H/P = "
                              f"{H // P}, so a fragment's exchange lands before its next one starts.")
        if not 0 <= cfg.alpha <= 1:
            raise ConfigError(f"--alpha must lie in [0, 1], got {cfg.alpha}.")


class Streaming(Eager, Guarding, Graced, Paced, Fragmented, Algorithm):
    name = "streaming"
    user_loop = AT_STEP_EDGES  # (diloco and a registered subclass inherit it)
    kind = PERIODIC
    elastic = True
    options = (OuterOptions, ExchangeOptions, StreamingOptions, PaceOptions, GuardOptions,
               EagerOptions)
    # 4 fragments, fewer for a smaller model (--model nano's 2 blocks): a model flag alone is
    # not refused for a fragment count it did not give
    defaults = {"fragments": lambda cfg: min(4, cfg.n_blocks()), "overlap": 1, "alpha": 0.5,
                "codec": "fp4-e3m0"}
    summary = ("Streaming DiLoCo: fragments synced in turn, overlapped with training, "
               "quantized exchange")
    loss_fit = "diloco"

    @classmethod
    def outer_link(cls, run):
        """Fragment p's average leaves after steps floor((p + 1) H / P) - 1 (mod H), each rank
        sending its 1/S slice over the outer group; the step tau + 1 later waits for it (its
        merge). diloco: P = 1, tau = 0."""
        H, P, T = run.sync_every, run.fragments, run.step_time
        return Schedule(T, 1, H, tuple((p + 1) * H // P - 1 for p in range(P)),
                        tuple(average(run, math.ceil(n / run.shards), 1 + run.overlap, T)
                              for n in run.fragment_sizes))

    def setup(self, model, blocks, make_optimizer, topology, comm, config):
        c = config
        if c.fragments > len(blocks):
            raise ConfigError(f"--fragments {c.fragments} is more than the model's {len(blocks)} "
                              "blocks: use at most one fragment per block.")
        self.inner = DDP(group="inner") if topology.shards > 1 else None
        if self.inner is not None:
            optimizer = self.inner.setup(model, blocks, make_optimizer, topology, comm, config)
        else:
            optimizer = make_optimizer(model.parameters())
        self.model, self.blocks, self.topo, self.comm, self.config = model, blocks, topology, comm, c
        self.optimizer = optimizer
        device = outer_home(c, topology.device)
        # when syncs start (--local-steps), from this rank's compute as the loop records it
        self.pace = Pace(c, comm, lambda: (self.compute_s, self.computed_steps))
        self._times = None  # the step times sent with the sync in flight (pace.start)
        self.fragments = [Fragment(i, ps, topology.shard, topology.shards, device)
                          for i, ps in enumerate(split_fragments(model, blocks, c.fragments,
                                                                 c.fragment_pattern))]
        # --elastic: each fragment's outer_digest after its last committed sync (quorum_tiebreak)
        self.lineage = [""] * len(self.fragments)
        # the outer state's copies on the device (outer.Staging): with --outer-state-device cpu
        # a fragment's outer parameters cross PCIe to the device once a sync (staged for the
        # exchange and used again by the apply: nothing changes them in between) and its
        # momentum once, both back once after the apply; on a GPU all of it on a side stream,
        # queued where it hides under a step's compute (the hooks below). Nothing is staged
        # with the state on the model's device.
        self.staging = Staging(device, topology.device)
        self.set_up_grace()  # --grace: the stand-in (algorithms/grace.py)
        self.guard = Guard(c, comm, topology, self._norm)  # --guard: every update judged
        self._good, self._best, self._rollbacks = None, math.inf, 0  # --rollback
        self.finished = False
        return optimizer

    def before_backward(self, step, micro, last):
        """Where the outer state's large copies start (--outer-state-device cpu on a GPU): before
        the step's last backward, which they run under. Its batches are on the device by then
        and the next small copy the host waits for (the gradient norm's) comes after the
        backward: a small copy queued behind a large one waits for it (measured on an H200:
        .item() behind a 244 MB copy on another stream took 4.4 ms, the large copy's time).
        Here the last apply's writes go back to host memory (put() kept them), and with tau > 0
        the outer parameters of the fragment whose exchange follows this step (its last apply
        was H - tau steps ago) and the momentum of one whose apply follows it (unchanged since
        its last apply) come to the device. With tau = 0 the exchange fetches both: its apply
        follows at once, and nothing of the state stays on the device while a step trains."""
        if self.inner is not None:
            self.inner.before_backward(step, micro, last)
        if not last:
            return
        self.staging.flush()
        if self.config.overlap == 0:
            return
        s = step + 1
        p = self.due(s)
        if p is not None:
            self.staging.fetch(self.fragments[p].outer)
        if self.config.outer_rule != "sparseloco":
            for f in self.fragments:  # (eager: the one whose outer step follows its start)
                if f.index == p if self.eager else f.pending is not None and f.pending[0] == s:
                    self.staging.fetch(f.momentum)

    def after_backward(self, step):
        if self.inner is not None:
            self.inner.after_backward(step)

    def due(self, s: int) -> int | None:
        """The fragment whose sync starts after inner step s (1-based), if any."""
        return self.pace.due(s)

    def after_step(self, step):
        s = step + 1
        c = self.config
        lr = self.lr(step) if self.guard.on else 0.0  # (what the guard judges norms by)
        for f in self.fragments:
            f.tokens += self.micro_batches() * c.batch_size * c.seq_len
            f.lr_sum += lr
        if self.grace is not None:  # the syncs this replica missed, as they land
            self.catch_up()
        for f in self.fragments:
            if f.pending is not None and f.pending[0] == s:
                self._apply(f)
        p = self.due(s)
        if p is not None:
            self._start(self.fragments[p], s)

    # the membership (comm/membership/; torchft's with --elastic): a quorum before each sync,
    # the commit vote before each apply; a heal hands over state_dict() at the start of a sync
    # or in the first quorum (nothing in flight then, but a resumed exchange that already landed)
    def join(self, step: int) -> None:
        if self.grace is not None:
            self.grace.start(self.pace.started)
        if self.comm.membership.join(step):  # restarted: the others are in the sync of
            s = self.healed_step               # healed_step; join it
            f = self.fragments[self.due(s)]
            self._times = self.pace.start(s)
            self._exchange(f, s)

    def quorum_tiebreak(self) -> int:
        return lineage_tiebreak(self.lineage)

    def healed(self) -> None:
        for f in self.fragments:
            f.residual = None  # error feedback is this group's own

    def _start(self, f: Fragment, s: int) -> None:
        if self.comm.membership.begin(s):  # behind the others: now a live peer's copy
            s = self.healed_step
            f = self.fragments[self.due(s)]
        if self.grace is not None and not self.grace.reserve(self.pace.started + 1):
            self.rejoin(s)  # its stand-in took part without it: late
            return
        self._times = self.pace.start(s, send=self.grace is None)
        self._exchange(f, s)

    def _exchange(self, f: Fragment, s: int) -> None:
        c = self.config
        outer = self.staging.get(f.outer)  # stays staged for the apply
        if c.overlap == 0 and c.outer_rule != "sparseloco":
            self.staging.fetch(f.momentum)  # for the apply right after: under the exchange
        delta = outer - f.local_slice()
        if f.residual is not None:  # sparseloco: e <- beta e + delta, beta the outer momentum
            delta.add_(f.residual, alpha=c.outer_momentum if c.outer_rule == "sparseloco" else 1.0)
        weight = f.tokens if c.merge_weights == "tokens" else None
        lr_sum, f.tokens, f.lr_sum = f.lr_sum, 0, 0.0
        if self.faults is not None:  # --corrupt: what this replica sends, corrupted
            self.faults.corrupt_sent(s, delta, self.comm.events)
        if self.grace is not None:  # its stand-in sends it, with the step time (pace.start)
            avg = self.grace.hand_in(self.pace.started, delta, weight, self._times)
            self._times = avg.times
        else:
            avg = self._average(f, delta, weight)
            avg = self.guard.wrap(avg, delta, weight, lr_sum, f.index, f"frag{f.index}",
                                  lambda x, w: self._average(f, x, w, "-again"))
        if c.error_feedback and c.codec != "fp32" and not self.comm.membership.healed_now:
            f.residual = delta - avg.sent
        f.pending = (s + c.overlap, s, avg)
        if c.overlap == 0:
            self._apply(f)
        elif self.eager:
            self.eager_start(f, avg)

    def _average(self, f: Fragment, x: torch.Tensor, weight, again: str = ""):
        c = self.config
        return self.comm.average(x, "outer", c.codec, exchange_block(c),
                                 tag=f"frag{f.index}{again}", exchange=c.exchange, weight=weight)

    @torch.no_grad()
    def _apply(self, f: Fragment) -> None:
        c = self.config
        applied, started, avg = f.pending
        f.pending = None
        if self.grace is not None:  # the syncs missed before it first, in order
            self.catch_up(before=getattr(avg, "k", 0), block=True)
        delta = avg.wait().to(self.topo.device)
        if not isinstance(avg, Landed):
            self._judged(f, avg)
        verdict = getattr(avg, "verdict", None)
        self.pace.decide(self._times, applied)  # adaptive: this period's steps, every replica's
        self._times = None
        if not self._vote(avg):
            # the vote failed: the outer state stays as it was
            self._uncommitted(f, self.pace.sync_step(started))
            return
        at = self.pace.sync_step(started)  # (adaptive: the run's step, not this replica's)
        self.recorded(verdict, at, f.index)
        if verdict is not None and verdict.everyone:  # every replica left out
            self._skip(f, at, "guard")
            return
        norm = verdict.norm if verdict is not None and verdict.norm is not None else \
            self._norm(delta)  # (the guard's bound took it)
        if not math.isfinite(norm):  # some replica's pseudo-gradient held NaN or inf
            self._skip(f, at)
            return
        self.skips = 0
        self.guard.applied += 1
        left = verdict is not None and self.topo.replica in verdict.left_out
        if left and self.eager:  # its own share, applied at the start, taken back
            self.eager_undo(f)
        restart = left and self._recover(f, avg)  # its weights went bad: restart from outer
        if self.eager:  # the others' share, for the fragment's next outer step
            outer = self.eager_landed(f, delta, restart)
        else:
            outer = self.outer_step(f, delta)
            merged = outer if restart else c.alpha * f.local_slice() + (1 - c.alpha) * outer
            write_flat(f.params, self._gather(f, merged))
        met = self.met(avg, applied, at) if self.grace is not None else {}
        if verdict is not None:  # each replica's norm over its learning rates, who was left out
            met["guard_norms"] = [round(n, 6) for n in verdict.norms]
            if verdict.left_out:
                met["left_out"] = sorted(verdict.left_out)
        if self.comm.events is not None:
            quorum = self.comm.membership.sync_fields(outer)  # elastic: quorum, outer digest
            if quorum:
                self.lineage[f.index] = quorum["outer_digest"]
            self.comm.events.emit("sync", step=at, fragment=f.index,
                                  applied_step=at + c.overlap,
                                  pseudo_grad_norm=norm, weight=self._weight(avg),
                                  anomaly=left, outer_lr=c.outer_lr, **quorum,
                                  **self.pace.fields(), **met)

    def outer_step(self, f: Fragment, delta: torch.Tensor) -> torch.Tensor:
        """The outer rule: fragment f's new outer parameters (this rank's slice, on delta's
        device) from the averaged pseudo-gradient `delta`, written to f.outer (and f.momentum)
        through self.staging. A subclass changes the rule here (examples/diloco_avg.py)."""
        c = self.config
        if c.outer_rule == "sparseloco":
            return sgd_step(f.outer, delta, c.outer_lr, self.staging)
        mu = outer_momentum_at(c, f.outer_steps)  # (--outer-warmup: ramped over the first)
        f.outer_steps += 1
        return nesterov_step(f.outer, f.momentum, delta, c.outer_lr, mu, self.staging)

    def _vote(self, avg) -> bool:
        """The commit vote on an exchange that has landed (taken at most once: a checkpoint
        takes it on the exchanges it drains, and stores it)."""
        committed = getattr(avg, "committed", None)
        return self.comm.membership.commit() if committed is None else committed

    def _weight(self, avg) -> float:
        """This replica's share of the average: its tokens' share (--merge-weights tokens), 1/R,
        or 1/(groups of the quorum) when elastic."""
        if getattr(avg, "share", None) is not None:
            return avg.share
        return 1 / len(self.comm.membership.members)

    def _uncommitted(self, f: Fragment, started: int) -> None:
        """An elastic exchange that did not commit (a group died mid-exchange, or too few took
        part): outer parameters and momentum stay, the local weights train on; the fragment's
        next sync carries what this one would have."""
        f.residual = None
        self.staging.drop(f.outer, f.momentum)
        if self.comm.events is not None:
            self.comm.events.emit("skip", step=started, what="commit", fragment=f.index)

    def _skip(self, f: Fragment, started: int, what: str = "pseudo-gradient") -> None:
        """Every replica sees the same non-finite average (or the guard left every replica out,
        `what` guard), so all skip this outer update alike: the outer parameters and momentum
        stay, and every replica's fragment restarts from them."""
        self.skips += 1
        f.residual = None
        if self.eager:  # its own share, applied at the start, taken back
            self.eager_undo(f)
        write_flat(f.params, self._gather(f, self.staging.get(f.outer)))
        self.staging.drop(f.outer, f.momentum)
        if what == "guard":
            self._recover(f, None)
        if self.comm.events is not None:
            self.comm.events.emit("skip", step=started, what=what, fragment=f.index)

    def state_dict(self) -> dict:
        """This rank's outer state; an exchange in flight is waited for and kept as landed
        (with --elastic, with its commit vote, taken now)."""
        self.staging.settle()  # the state's writes to host memory, flushed and done
        settle(self.topo.device)
        for f in self.fragments:
            if f.pending is not None and not isinstance(f.pending[2], Landed):
                apply_at, started, avg = f.pending
                value = avg.wait()
                self._judged(f, avg)
                f.pending = (apply_at, started, Landed(value, self._vote(avg),
                                                       getattr(avg, "share", None),
                                                       getattr(avg, "absent", None),
                                                       getattr(avg, "verdict", None)))
        frags = [{"outer": f.outer, "momentum": f.momentum, "residual": f.residual, "rest": f.rest,
                  "pending": self._landed(f), "tokens": f.tokens, "lr_sum": f.lr_sum,
                  "outer_steps": f.outer_steps}
                 for f in self.fragments]
        healing = self.comm.membership.heal_fields({"lineage": list(self.lineage)})
        pace = {}
        if self.pace.adaptive:  # the times sent with the sync in flight, landed too
            times = None if self._times is None else [t.tolist() for t in self._times.wait()]
            self._times = None if times is None else Landed(torch.tensor(times))
            pace = {"pace": {**self.pace.state_dict(), "times": times}}
        return {"fragments": frags, "skips": self.skips, "guard": self.guard.state_dict(),
                **healing, **pace}

    @staticmethod
    def _landed(f: Fragment) -> list | None:
        if f.pending is None:
            return None
        apply_at, started, landed = f.pending
        verdict = None if landed.verdict is None else landed.verdict.state()
        return [apply_at, started, landed.value, landed.committed, landed.share, verdict]

    def load_state_dict(self, state: dict) -> None:
        self.staging.settle()
        settle(self.topo.device)
        self.staging.drop()
        for f, st in zip(self.fragments, state["fragments"]):
            f.outer.copy_(st["outer"])
            f.momentum.copy_(st["momentum"])
            f.residual = st["residual"]
            f.rest = st.get("rest")  # (--outer-update eager)
            f.tokens = st.get("tokens", 0)
            f.lr_sum = st.get("lr_sum", 0.0)
            f.outer_steps = st.get("outer_steps", 0)
            p = st["pending"]
            f.pending = None if p is None else (p[0], p[1], Landed(
                p[2], *(p + [None, None])[3:5], verdict=Verdict.from_state((p + [None])[5])))
        self.skips = state["skips"]
        self.guard.load_state_dict(state.get("guard"))
        self.lineage = list(state.get("lineage", [""] * len(self.fragments)))
        if "pace" in state:
            self.pace.load_state_dict(state["pace"])
            times = state["pace"]["times"]
            self._times = None if times is None else Landed(torch.tensor(times))

    def finish(self):
        """Land the exchanges still in flight, in the order they started."""
        self.finished = True  # (the final evaluation rolls nothing back)
        for f in sorted((f for f in self.fragments if f.pending), key=lambda f: f.pending[1]):
            self._apply(f)
        if self.eager:
            self.eager_finish()
        if self.grace is not None:  # the syncs left, which this replica took no part in
            for met in self.grace.close(self.pace.total if self.pace.over() else
                                        self.pace.started):
                self._rebase(met)

class DiLoCo(Streaming):
    name = "diloco"
    defaults = {"fragments": 1, "overlap": 0, "alpha": 0.0, "codec": "fp32"}
    summary = "DiLoCo: the whole model averaged every H steps, outer Nesterov SGD"

    @classmethod
    def check(cls, cfg) -> None:
        if (cfg.fragments, cfg.overlap) != (1, 0):
            raise ConfigError("diloco syncs the whole model with no overlap: use --algo streaming "
                              "for --fragments above 1 or --overlap above 0.")
