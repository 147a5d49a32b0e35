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
whole local model restarts from the outer parameters (algorithms/streaming.py), so it rejoins
clean. Everyone left out: the outer step is skipped and every replica's fragment restarts from
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
from dataclasses import dataclass, field

import torch

from lowband.options import ConfigError, Options, option
from lowband.params import write_flat

# an honest merge's norm is at most the weighted mean of the norms merged (triangle inequality);
# what each codec's rounding may add to a sent vector's norm stays under this factor (fp4-e3m0,
# the coarsest relative to each value: a third)
BOUND_SLACK = 1.5


@dataclass
class GuardOptions(Options):
    title = "guarded outer step"
    guard: str = option(None, "judge every replica's pseudo-gradient before the outer step: norm "
                        "(leave out one that is not finite or whose norm is far above its usual "
                        "or its peers') or off", ("norm", "off"), kind=str,
                        shown="norm; off with --grace, whose stand-ins merge without waiting")
    guard_ratio: float = option(2.0, "leave out a pseudo-gradient whose norm rose above this "
                                "many times its replica's usual one for the fragment, when it "
                                "also stands --guard-peers above every other replica's")
    guard_peers: float = option(4.0, "leave out a pseudo-gradient whose norm is above this many "
                                "times the replicas' median (3 or more replicas), or every other "
                                "replica's norm when it also rose --guard-ratio above its usual")
    guard_warmup: int = option(1, "syncs of a fragment a replica has behind it before its own "
                               "history judges it")
    guard_rate: float = option(0.5, "how fast a replica's usual norm follows a rise of its "
                               "norms (a share of the distance in logs, a sync; a fall it "
                               "follows at once)")

    @classmethod
    def resolve(cls, cfg, algorithm) -> None:
        if cfg.guard is None:
            cfg.guard = "off" if getattr(cfg, "grace", 0) else "norm"

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
    scaled: float = 1.0  # the merge scaled down to the bound (an inconsistent claim)

    @property
    def everyone(self) -> bool:
        return bool(self.weighed) and set(self.left_out) >= set(self.weighed)

    def state(self) -> dict:
        return {"left_out": {str(r): list(v) for r, v in self.left_out.items()},
                "weighed": self.weighed, "norms": self.norms, "bound": self.bound,
                "again": self.again,
                "scaled": self.scaled}

    @classmethod
    def from_state(cls, s: dict | None) -> "Verdict | None":
        if s is None:
            return None
        return cls({int(r): tuple(v) for r, v in s["left_out"].items()}, list(s["weighed"]),
                   list(s["norms"]), float(s["bound"]), bool(s["again"]), float(s["scaled"]))


def why_text(replica: int, step: int, why: tuple) -> str:
    """'replica 1's update at step 40 was left out: its norm was 35x its usual'."""
    reason, norm, ref = why
    head = f"replica {replica}'s update at step {step} was left out: "
    if reason == "non-finite":
        return head + "it was not finite"
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
                 again):
        self.guard, self.avg, self.norms, self.delta = guard, avg, norms, delta
        self.weight, self.fragment, self.again = weight, fragment, again
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
        rows = [tuple(float(x) for x in r.tolist()) for r in self.norms.wait()]
        rows = [(r, math.sqrt(sq) / lr if math.isfinite(sq) and lr > 0 else math.sqrt(sq), w)
                for r, sq, w, lr in rows]
        v = self.verdict = self.guard.judge(self.fragment, rows)
        if v.left_out and not v.everyone:
            me = self.guard.replica in v.left_out
            x = torch.zeros_like(self.delta) if me else self.delta
            redo = self.again(x, 0.0 if me else (1.0 if self.weight is None else self.weight))
            value, v.again = redo.wait(), True
            self.share, self.sent = redo.share, redo.sent
            self.residual = None if me else self.delta - redo.sent  # (error feedback's)
        if not v.everyone and math.isfinite(v.bound):
            norm = self.guard.norm(value)
            if norm > BOUND_SLACK * v.bound:
                v.scaled = BOUND_SLACK * v.bound / norm
                value.mul_(v.scaled)
        self.delta = None
        self.value = value
        return value.clone()


class Guard:
    """This rank's guard over one algorithm's syncs: the history of every replica's norms per
    fragment (the same on every rank), and the verdicts so far (summary.json's `left_out`)."""

    def __init__(self, cfg, comm, topo):
        self.cfg, self.comm, self.topo = cfg, comm, topo
        self.on = getattr(cfg, "guard", "off") == "norm"
        self.replica = getattr(topo, "replica", 0)
        self.history: dict[int, dict] = {}  # fragment -> {replica: [mean log norm, syncs]}
        self.records: list[dict] = []  # one per left-out update or bounded merge

    def wrap(self, avg, delta: torch.Tensor, weight, lr_sum: float, fragment: int, tag: str,
             again):
        """`avg` (an exchange just started) under the guard, its norms sent beside it (lr_sum:
        the inner learning rates' sum over the steps `delta` trained); again(x, w) starts the
        fragment's average once more with this replica's x and weight w."""
        if not self.on:
            return avg
        sq = delta.double().pow(2).sum().reshape(1)
        if self.topo.shards > 1:  # the whole fragment's: every slice of this replica summed
            sq = self.comm.all_reduce(sq.to(delta.device), "inner", tag=f"{tag}-norm").wait()
        w = 0.0 if self.comm.membership.healed_now else (1.0 if weight is None else float(weight))
        row = torch.tensor([float(self.replica), float(sq), w, lr_sum], dtype=torch.float64,
                           device=delta.device)
        norms = self.comm.membership.all_gather(self.comm, row, f"{tag}-norm")
        return Guarded(self, avg, norms, delta, weight, fragment, again)

    def judge(self, fragment: int, rows) -> Verdict:
        return judge(rows, self.history.setdefault(fragment, {}), self.cfg)

    def norm(self, value: torch.Tensor) -> float:
        sq = value.double().pow(2).sum().reshape(1)
        if self.topo.shards > 1:
            sq = self.comm.all_reduce(sq, "inner", tag="bound").wait()
        return math.sqrt(float(sq))

    def record(self, verdict: Verdict, step: int, fragment: int) -> list[dict]:
        """The records of one verdict (also kept for summary.json): one per left-out replica,
        and one where the merge was scaled down to its bound."""
        out = []
        for r, why in sorted(verdict.left_out.items()):
            out.append({"step": step, "fragment": fragment, "left_out": r, "why": why[0],
                        "norm_per_lr": why[1], "usual_per_lr": why[2],
                        "times": why[1] / why[2] if why[2] > 0 else None,
                        "everyone": verdict.everyone,
                        "text": why_text(r, step, why)})
        if verdict.scaled < 1:
            out.append({"step": step, "fragment": fragment, "why": "inconsistent",
                        "scaled": verdict.scaled,
                        "text": f"the merge at step {step} was larger than the norms the replicas "
                                f"sent allow: scaled by {verdict.scaled:.3g}"})
        self.records.extend(out)
        return out

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
    def _restart(self, f) -> None:
        """This replica was left out (or everyone was): fragment f restarted from the outer
        parameters (the caller wrote them), its error feedback and its count of tokens and
        learning rates since then start afresh; where the replica's weights are no longer
        finite, every other fragment restarts too, and inner-optimizer state that is no longer
        finite starts afresh (a replica that stayed bad elsewhere shows at those fragments'
        syncs, which leave it out in turn)."""
        broken = not all(torch.isfinite(p).all() for p in self.model.parameters())
        for g in self.fragments:
            if g is f or broken:
                g.residual, g.tokens, g.lr_sum = None, 0, 0.0
            if g is not f and broken:
                write_flat(g.params, self._gather(g, self.staging.get(g.outer, keep=False)))
        for p in self.model.parameters():
            state = self.optimizer.state.get(p)
            if state and not all(torch.isfinite(v).all() for v in state.values()
                                 if torch.is_tensor(v)):
                self.optimizer.state[p] = {}
