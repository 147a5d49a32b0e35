"""The guarded outer step (--guard norm, diloco's and streaming's default): every replica's
pseudo-gradient is judged before it is merged, and one that fails is left out.

Beside each exchange of a fragment's pseudo-gradients, every replica sends four numbers: its
replica id, the squared norm of its pseudo-gradient (the whole fragment's: a sharded replica
sums its slices over the fast inner link first), its weight in the merge (1, its tokens with
--merge-weights tokens, 0 for an --elastic group healed in this quorum) and the sum of the inner
learning rates of the steps it trained the fragment since the fragment's last sync. The norm
judged is the norm over that sum (an inner step moves the weights in proportion to its learning
rate): a schedule's warm-up or decay, or a replica that trained more steps, is no anomaly. That
small all-gather travels at the same time as the exchange, so a clean sync costs no wait. From
those numbers alone every rank decides the same (`judge`), in replica order:

  non-finite   a norm that is NaN or inf: always left out;
  peers        with 3 or more replicas weighed, a norm above --guard-peers x the median of theirs;
  norm         a norm above --guard-peers x every other weighed replica's norm that has also
               risen above --guard-ratio x the replica's usual one for that fragment (once it
               has --guard-warmup syncs of the fragment behind it): at R = 2, where comparing
               the two cannot say which is bad, the one that left its own usual. Replicas whose
               norms rise alike are the run changing, not a fault (so with one replica weighed,
               only non-finite counts). The usual norm follows the replica's norms there, a fall
               at once and a rise at --guard-rate of its distance in logs a sync (measured on
               the main job and diloco R = 4: a clean run's norms stay within 1.6x their usual).

Nobody left out: the exchange's own average is the merge, so a clean run's numbers are those of
a run without the guard, bit for bit. Someone left out: the fragment is averaged again with the
left-out replicas weighing 0 (their pseudo-gradients never enter the outer state; the others'
weights renormalized), a blocking exchange the records count as a wait; a left-out replica's
weights are judged against its own usual norms, and the fragments whose weights left them
restart from the outer parameters (Guarding._recover), so it rejoins clean. Everyone left out: the outer step is skipped and every replica's fragment restarts from
the outer parameters. A left-out norm is not folded into its replica's history (a replica that
stays bad stays left out); the others' are.

What the numbers cannot show. A replica's norm is its own word: a member holding the run's
secret could send a vector larger than the norm it claims. The merged average is therefore
bounded: its norm may not exceed BOUND_SLACK x the weighted mean of the claimed norms of the
replicas weighed (the triangle inequality bounds an honest average by that mean; the slack
covers the codecs' rounding), and is scaled down to it where it does (an `inconsistent` record).
Within that bound such a member, or a sign flipped in transit, still moves the outer step: the
guard judges sizes, not directions. docs/faults.md says what that means.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch

from lowband.options import ConfigError, Options, option
from lowband.params import digest, write_flat

# an honest merge's norm is at most the weighted mean of the norms merged (triangle inequality);
# what each codec's rounding may add to a sent vector's norm stays under this factor (fp4-e3m0,
# the coarsest relative to each value: a third)
BOUND_SLACK = 1.5
ROLLBACK = 1.5  # --rollback's default: a validation loss above 1.5x the best so far
ROLLBACKS_IN_A_ROW = 3  # a run still bad after this many rollbacks in a row goes on (diverged)


@dataclass
class GuardOptions(Options):
    title = "guarded outer step"
    guard: str = option(None, "judge every replica's pseudo-gradient before the outer step: norm "
                        "(leave out one that is not finite or whose norm is far above its usual "
                        "or its peers'), edit (EDiT's penalty, --edit-*: edit and aedit) or off",
                        ("norm", "edit", "off"), kind=str,
                        shown="edit for edit and aedit, else norm; off with --grace, whose "
                        "stand-ins merge without waiting")
    guard_ratio: float = option(2.0, "leave out a pseudo-gradient whose norm rose above this "
                                "many times its replica's usual one for the fragment, when it "
                                "also stands --guard-peers above every other replica's")
    guard_peers: float = option(4.0, "leave out a pseudo-gradient whose norm is above this many "
                                "times the replicas' median (3 or more replicas), or every other "
                                "replica's norm when it also rose --guard-ratio above its usual")
    guard_warmup: int = option(1, "syncs of a fragment a replica has behind it before its own "
                               "history judges it")
    rollback: float = option(None, "the last line of defence (diloco, streaming): when an "
                             "evaluation's validation loss is above this many times the best so "
                             "far, the outer state rolls back to the last good evaluation's and "
                             "every replica restarts from it (0: never)", kind=float,
                             shown="1.5; 0 with --grace or --guard off")
    guard_rate: float = option(0.5, "how fast a replica's usual norm follows a rise of its "
                               "norms (a share of the distance in logs, a sync; a fall it "
                               "follows at once)")

    @classmethod
    def resolve(cls, cfg, algorithm) -> None:
        own = getattr(algorithm, "guard_default", "norm")  # edit and aedit: their penalty
        if cfg.guard is None:
            cfg.guard = "off" if getattr(cfg, "grace", 0) else own
        if cfg.rollback is None:
            cfg.rollback = 0.0 if getattr(cfg, "grace", 0) or cfg.guard == "off" or \
                own == "edit" else ROLLBACK
        if cfg.guard == "edit" and own != "edit":
            raise ConfigError(f"--guard edit is EDiT's pseudo-gradient penalty, which --algo "
                              f"{cfg.algo} does not have: use --guard norm or off.")

    @classmethod
    def check(cls, cfg) -> None:
        for name in ("guard_ratio", "guard_peers"):
            if not getattr(cfg, name) > 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be above 1 (a multiple of the "
                                  f"usual norm), got {getattr(cfg, name)}.")
        if cfg.guard_warmup < 1:
            raise ConfigError(f"--guard-warmup must be a positive number of syncs, got "
                              f"{cfg.guard_warmup}.")
        if not 0 < cfg.guard_rate <= 1:
            raise ConfigError(f"--guard-rate must lie in (0, 1], got {cfg.guard_rate}.")
        if cfg.rollback and not cfg.rollback > 1:
            raise ConfigError(f"--rollback must be above 1 (a multiple of the best validation "
                              f"loss) or 0 (never), got {cfg.rollback}.")
        if cfg.rollback and cfg.algo in ("edit", "aedit"):
            raise ConfigError(f"--rollback restores diloco's and streaming's outer state; "
                              f"--algo {cfg.algo} has none to roll back: drop --rollback.")
        if cfg.rollback and getattr(cfg, "grace", 0):
            raise ConfigError("--rollback and --grace do not go together (a late replica's "
                              "syncs are still landing): drop one of them.")
        if cfg.guard == "norm" and getattr(cfg, "grace", 0):
            raise ConfigError("--grace merges without waiting for every replica's norm: use "
                              "--guard off with --grace.")


@dataclass
class Verdict:
    """One sync's judgement: `left_out` maps a replica to (why, its norm, the norm it was held
    against: its usual or the median); `bound` is the weighted mean of the kept norms."""
    left_out: dict = field(default_factory=dict)
    weighed: list = field(default_factory=list)  # the replicas with weight, in replica order
    norms: list = field(default_factory=list)  # their norms over their learning rates' sums
    bound: float = math.inf
    again: bool = False  # averaged again without the left-out replicas
    mine_lr: float = 0.0  # this rank's learning rates' sum over what it sent (its own check)
    scaled: float = 1.0  # the merge scaled down to the bound (an inconsistent claim)
    norm: float | None = None  # the merge's norm, as it is applied (the sync event's)

    @property
    def everyone(self) -> bool:
        return bool(self.weighed) and set(self.left_out) >= set(self.weighed)

    def state(self) -> dict:
        return {"left_out": {str(r): list(v) for r, v in self.left_out.items()},
                "weighed": self.weighed, "norms": self.norms, "bound": self.bound,
                "again": self.again,
                "scaled": self.scaled, "mine_lr": self.mine_lr, "norm": self.norm}

    @classmethod
    def from_state(cls, s: dict | None) -> "Verdict | None":
        if s is None:
            return None
        return cls(left_out={int(r): tuple(v) for r, v in s["left_out"].items()},
                   weighed=list(s["weighed"]), norms=list(s["norms"]), bound=float(s["bound"]),
                   again=bool(s["again"]), mine_lr=float(s.get("mine_lr", 0.0)),
                   scaled=float(s["scaled"]), norm=s.get("norm"))


def why_text(replica: int, step: int, why: tuple) -> str:
    """'replica 1's update at step 40 was left out: its norm was 35x its usual'."""
    reason, norm, ref = why
    head = f"replica {replica}'s update at step {step} was left out: "
    if reason == "non-finite":
        return head + "it was not finite"
    if reason == "z-score":  # EDiT's penalty (--guard edit): its z-score and the threshold
        return head + f"its norm's z-score was {norm:,.3g}, above {ref:g} (EDiT's penalty)"
    times = norm / ref if ref > 0 else math.inf
    return head + (f"its norm was {times:,.3g}x its usual" if reason == "norm" else
                   f"its norm was {times:,.3g}x the replicas' median")


def judge(rows: list[tuple[int, float, float]], history: dict, cfg) -> Verdict:
    """The verdict on one fragment's sync from every replica's (id, norm, weight), the norm
    over its learning rates' sum, and its replicas' `history` ({replica: [mean log norm,
    syncs]}), which it updates in place."""
    weighed = sorted((int(r), n, w) for r, n, w in rows if w > 0)
    v = Verdict(weighed=[r for r, _, _ in weighed], norms=[n for _, n, _ in weighed])
    for r, n, _ in weighed:
        if not math.isfinite(n):
            v.left_out[r] = ("non-finite", n, math.nan)
    finite = [(r, n) for r, n, _ in weighed if r not in v.left_out]
    if len(weighed) >= 3 and finite:
        median = statistics.median(n for _, n in finite)
        for r, n in finite:
            if n > cfg.guard_peers * median:
                v.left_out[r] = ("peers", n, median)
    for r, n in finite:
        h = history.get(r)
        others = [m for q, m in finite if q != r]
        if h is not None and h[1] >= cfg.guard_warmup and others and \
                n > cfg.guard_ratio * math.exp(h[0]) and n > cfg.guard_peers * max(others):
            v.left_out.setdefault(r, ("norm", n, math.exp(h[0])))
    for r, n in finite:
        if r in v.left_out or not n > 0:
            continue
        h, x = history.get(r), math.log(n)
        history[r] = [x, 1] if h is None else \
            [x if x < h[0] else h[0] + cfg.guard_rate * (x - h[0]), h[1] + 1]
    kept = [(n, w) for r, n, w in weighed if r not in v.left_out]
    if kept:
        v.bound = sum(n * w for n, w in kept) / sum(w for _, w in kept)
    return v


class Guarded:
    """An average in flight under the guard: wait() gathers the norms sent beside it, judges
    them (Guard.judge) and, where someone is left out, averages again without them; the result
    is bounded by the kept norms (module doc). `verdict` is set once it has landed."""

    def __init__(self, guard: "Guard", avg, norms, delta: torch.Tensor, weight, fragment: int,
                 again, lr_sum: float = 0.0):
        self.guard, self.avg, self.norms, self.delta = guard, avg, norms, delta
        self.weight, self.fragment, self.again, self.lr_sum = weight, fragment, again, lr_sum
        self.sent = avg.sent
        self.verdict: Verdict | None = None
        self.value = None

    def __getattr__(self, name):  # share, absent, k: the exchange's own
        if name in ("avg",):
            raise AttributeError(name)
        return getattr(self.avg, name)

    def done(self) -> bool:
        return self.value is not None or (self.avg.done() and self.norms.done())

    def wait(self) -> torch.Tensor:
        if self.value is not None:
            return self.value.clone()
        value = self.avg.wait()
        t0 = time.perf_counter()
        rows = [tuple(float(x) for x in r.tolist()) for r in self.norms.wait()]
        rows = [(r, math.sqrt(sq) / lr if math.isfinite(sq) and lr > 0 else math.sqrt(sq), w)
                for r, sq, w, lr in rows]
        v = self.verdict = self.guard.judge(self.fragment, rows)
        v.mine_lr = self.lr_sum
        self.guard.seconds += time.perf_counter() - t0
        if v.left_out and not v.everyone:
            me = self.guard.replica in v.left_out
            x = torch.zeros_like(self.delta) if me else self.delta
            redo = self.again(x, 0.0 if me else (1.0 if self.weight is None else self.weight))
            value, v.again = redo.wait(), True
            self.share, self.sent = redo.share, redo.sent
            self.residual = None if me else self.delta - redo.sent  # (error feedback's)
        if not v.everyone and math.isfinite(v.bound):
            v.norm = self.guard.norm(value)
            if v.norm > BOUND_SLACK * v.bound:
                v.scaled = BOUND_SLACK * v.bound / v.norm
                value.mul_(v.scaled)
                v.norm = self.guard.norm(value)
        self.delta = None
        self.value = value
        return value.clone()


class Guard:
    """This rank's guard over one algorithm's syncs: the history of every replica's norms per
    fragment (the same on every rank), and the verdicts so far (summary.json's `left_out`)."""

    def __init__(self, cfg, comm, topo, norm=None):
        """norm: the algorithm's norm of a merged value over the whole fragment (every shard's
        slice: Fragmented._norm), for the bound (wrap's exchanges only)."""
        self.cfg, self.comm, self.topo, self.norm = cfg, comm, topo, norm
        self.on = getattr(cfg, "guard", "off") != "off"
        self.replica = getattr(topo, "replica", 0)
        self.history: dict[int, dict] = {}  # fragment -> {replica: [mean log norm, syncs]}
        self.records: list[dict] = []  # one per left-out update, bounded merge or rollback
        self.applied = 0  # the outer steps applied (a rollback says how many it undid)
        self.seconds = 0.0  # the guard's own work on this rank: the norms sent, their verdicts

    def wrap(self, avg, delta: torch.Tensor, weight, lr_sum: float, fragment: int, tag: str,
             again):
        """`avg` (an exchange just started) under the guard, its norms sent beside it (lr_sum:
        the inner learning rates' sum over the steps `delta` trained, work carried from a sync
        it was left out of included); again(x, w) starts the fragment's average once more with
        this replica's x and weight w."""
        if not self.on:
            return avg
        t0 = time.perf_counter()
        sq = delta.double().pow(2).sum().reshape(1)
        if self.topo.shards > 1:  # the whole fragment's: every slice of this replica summed
            sq = self.comm.all_reduce(sq.to(delta.device), "inner", tag=f"{tag}-norm").wait()
        w = 0.0 if self.comm.membership.healed_now else (1.0 if weight is None else float(weight))
        known = torch.tensor([float(self.replica), w, lr_sum], dtype=torch.float64)
        row = torch.cat([known[:1].to(delta.device), sq.reshape(1),  # (no wait for the norm)
                         known[1:].to(delta.device)])
        norms = self.comm.membership.all_gather(self.comm, row, f"{tag}-norm")
        self.seconds += time.perf_counter() - t0
        return Guarded(self, avg, norms, delta, weight, fragment, again, lr_sum)

    def judge(self, fragment: int, rows) -> Verdict:
        return judge(rows, self.history.setdefault(fragment, {}), self.cfg)

    def record(self, verdict: Verdict, step: int, fragment: int) -> list[dict]:
        """The records of one verdict (also kept for summary.json): one per left-out replica,
        and one where the merge was scaled down to its bound."""
        out = [self.note(step, fragment, r, why, verdict.everyone)
               for r, why in sorted(verdict.left_out.items())]
        if verdict.scaled < 1:
            out.append({"step": step, "fragment": fragment, "why": "inconsistent",
                        "scaled": verdict.scaled,
                        "text": f"the merge at step {step} was larger than the norms the replicas "
                                f"sent allow: scaled by {verdict.scaled:.3g}"})
            self.records.append(out[-1])
        return out

    def note(self, step: int, fragment, replica: int, why: tuple, everyone: bool) -> dict:
        """The record of one update left out, kept for summary.json (edit and aedit note their
        penalty's flags here)."""
        record = {"step": step, "fragment": fragment, "left_out": replica, "why": why[0],
                  "norm_per_lr": why[1], "usual_per_lr": why[2],
                  "times": why[1] / why[2] if why[0] in ("norm", "peers") and why[2] > 0 else None,
                  "everyone": everyone, "text": why_text(replica, step, why)}
        if record not in self.records:
            self.records.append(record)
        return record

    def state_dict(self) -> dict:
        return {"history": {str(f): {str(r): list(h) for r, h in hs.items()}
                            for f, hs in self.history.items()}, "records": list(self.records)}

    def load_state_dict(self, state: dict | None) -> None:
        if not state:
            return
        self.history = {int(f): {int(r): list(h) for r, h in hs.items()}
                        for f, hs in state["history"].items()}
        self.records = list(state["records"])


class Guarding:
    """What an algorithm with fragments (streaming.py: `fragments`, `staging`, `_gather`,
    `model`, `optimizer`) does with the guard's verdicts: the error feedback of a fragment
    averaged again, a left-out replica's restart, the records."""

    def recorded(self, verdict: Verdict | None, step: int, fragment: int) -> None:
        """The `guard` events of a verdict (and its records for summary.json)."""
        records = self.guard.record(verdict, step, fragment) if verdict is not None else []
        for record in records if self.comm.events is not None else ():
            self.comm.events.emit("guard", **record)

    def _judged(self, f, avg) -> None:
        """Once a guarded exchange has landed: the error feedback of what was averaged again
        (algorithms/guard.py), none for a replica left out."""
        verdict = getattr(avg, "verdict", None)
        if verdict is None or not (verdict.again or verdict.everyone):
            return
        left = verdict.everyone or self.topo.replica in verdict.left_out
        if f.residual is not None:
            f.residual = None if left else avg.residual

    @torch.no_grad()
    def _recover(self, f, avg) -> bool:
        """This replica was left out of fragment f's merge (avg: that exchange; None: everyone
        was, and the caller restarted f). Its local weights are judged against its own usual
        norms: a fragment whose weights left them (not finite, or their distance from the outer
        parameters over the learning rates since above --guard-ratio x the usual) restarts from
        the outer parameters, its inner-optimizer state, error feedback and counts afresh; one
        whose weights are fine keeps them (what went bad was what it sent: its work merges at
        the fragment's next sync). Returns whether f's own weights were off (the caller then
        writes f's outer parameters). Called before f's outer step."""
        me, ratio = self.guard.replica, self.config.guard_ratio

        def off(g, lr: float) -> bool:
            x = self._norm(self.staging.get(g.outer, keep=False) - g.local_slice())
            h = self.guard.history.get(g.index, {}).get(me)
            return not math.isfinite(x) or (h is not None and lr > 0 and
                                            x / lr > ratio * math.exp(h[0]))

        mine = 0.0 if avg is None else getattr(getattr(avg, "verdict", None), "mine_lr", 0.0)
        broken = avg is None or off(f, mine + f.lr_sum)
        if not broken:  # its work there stays in its weights (the share the merge keeps) and
            f.lr_sum += self.config.alpha * mine  # travels with the fragment's next sync
        for g in self.fragments:
            if not (broken if g is f else off(g, g.lr_sum)):
                continue
            if g is not f:
                write_flat(g.params, self._gather(g, self.staging.get(g.outer, keep=False)))
            g.residual, g.tokens, g.lr_sum = None, 0, 0.0
            for p in g.params:  # moments afresh, the step count kept (no bias-corrected jump)
                for k, v in self.optimizer.state.get(p, {}).items():
                    if torch.is_tensor(v) and k != "step":
                        v.zero_()
        return broken

    def evaluated(self, step: int, val_loss: float) -> None:
        """--rollback: after an evaluation every rank took (val_loss: the mean over replicas,
        the same on every rank), keep the outer state as the last good one, or, where the loss
        jumped above --rollback x the best so far (or is not finite), roll back to it."""
        factor = getattr(self.config, "rollback", 0.0)
        if not factor or getattr(self, "finished", False):
            return
        good = getattr(self, "_good", None)
        best = getattr(self, "_best", math.inf)
        bad = not math.isfinite(val_loss) or val_loss > factor * best
        if bad and good is not None and self._rollbacks < ROLLBACKS_IN_A_ROW:
            self._roll_back(step, val_loss, factor)
            return
        if bad:
            return
        self._best, self._rollbacks = min(best, val_loss), 0
        self.staging.settle()
        self._good = (step, self.guard.applied, [(f.outer.clone(), f.momentum.clone())
                                                 for f in self.fragments])

    @torch.no_grad()
    def _roll_back(self, step: int, val_loss: float, factor: float) -> None:
        """The exchanges in flight land as usual, then every fragment's outer parameters and
        momentum are the last good evaluation's and every replica restarts from them."""
        to_step, applied, kept = self._good
        for f in sorted((f for f in self.fragments if f.pending), key=lambda f: f.pending[1]):
            self._apply(f)
        self.staging.settle()
        for f, (outer, momentum) in zip(self.fragments, kept):
            f.outer.copy_(outer)
            f.momentum.copy_(momentum)
            self.staging.drop(f.outer, f.momentum)
            write_flat(f.params, self._gather(f, self.staging.get(f.outer, keep=False)))
            f.residual, f.tokens, f.lr_sum = None, 0, 0.0
        self._rollbacks = getattr(self, "_rollbacks", 0) + 1
        undone = self.guard.applied - applied
        record = {"step": step, "fragment": None, "why": "rollback", "to_step": to_step,
                  "val_loss": val_loss, "best_val_loss": self._best, "syncs_undone": undone,
                  "outer_sha256": digest(self.outer_params()),  # (as summary.json's)
                  "text": f"the validation loss at step {step} was {val_loss:.4g}, above "
                          f"{factor:g}x its best ({self._best:.4g}): the outer state rolled back "
                          f"to step {to_step}'s, {undone} {'sync' if undone == 1 else 'syncs'} "
                          "undone"}
        self.guard.records.append(record)
        if self.comm.events is not None:
            self.comm.events.emit("rollback", **{k: v for k, v in record.items()
                                                 if k not in ("fragment", "why")})
