"""--outer-update eager: streaming's overlapped syncs with eager outer updates (Kale, Douillard,
Donchev 2025, "Eager Updates For Overlapped Communication and Computation in DiLoCo", arXiv
2502.12996): a replica's own pseudo-gradient stands in for its share of the average at once,
and the other replicas' shares enter its outer step one sync of the fragment later.

Replica m of R, fragment p, its k-th sync started after step s_k (streaming.py), tau >= 1. What
the replica has at s_k: its own pseudo-gradient Delta_m^k (sent in the codec: sent_m^k, what
the others decode of it) and the average of sync k-1, landed at s_{k-1} + tau; at s_k + tau it
has the average avg^k = sum_j sent_j^k / R. With e_m^k = sent_m^k / R, its own share:

  delayed (default)  at s_k + tau: theta_outer <- OuterStep(theta_outer, avg^k)
                                   theta <- alpha theta + (1 - alpha) theta_outer
  eager              at s_k:       g = e_m^k + r_m;  theta_outer_m <- OuterStep(theta_outer_m, g)
                                   theta <- alpha theta + (1 - alpha) theta_outer_m;  r_m <- -e_m^k
                     at s_k + tau: r_m <- r_m + avg^k  (= sum_{j != m} sent_j^k / R, the others')

so the k-th outer step takes g = e_m^k + avg^{k-1} - e_m^{k-1} = Delta_m^k / R + sum_{j != m}
Delta_j^{k-1} / R, the paper's eager outer gradient (OuterStep: Nesterov, or sgd_step with
--outer-rule sparseloco; r_m is 0 before the first sync). At the run's end the exchanges in
flight land and each fragment takes one last outer step with g = r_m (the others' share of its
last sync) and merges. Every average is applied once by every replica, only its own share one
sync earlier than the others'; r_m is the part of the averages landed or in flight that this
replica has not applied yet (a checkpoint keeps it, so a resume is bitwise). With tau = 0 the
average lands at s_k, where eager is the delayed update: refused. Each replica applies its own
share first, so the replicas' outer parameters differ between syncs by O(outer lr x |Delta| / R):
outer.pt holds the first replica's (rank 0's), --eval-params outer evaluates each replica's own
(the run's validation loss is their mean, as always), summary.json's outer_states_agree is
false, and each rank's checkpoint keeps its own.

The guard (guard.py) judges the norms sent beside the exchange and gives its verdict when it
lands, as with delayed; the own share was applied before it, so a replica left out (or every
replica, at a skipped sync: a non-finite average, or everyone left out) takes it back at once
(eager_undo: the outer step's part of it undone, its weights moved with the outer parameters)
and keeps r_m = the average without it (0 for a skip). A value of its own share that is not
finite is never applied (0 there). A left-out replica whose weights are off restarts from its
outer parameters, as with delayed. --rollback restores the outer parameters and momentum
and forgets r_m. The replica's share must be known at s_k: not
with --merge-weights tokens (a share from the tokens of all), --grace (merges by tokens) or
--elastic (a quorum's size and heals), each refused in one sentence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowband.algorithms.outer import outer_momentum_at
from lowband.options import ConfigError, Options, option
from lowband.params import write_flat


@dataclass
class EagerOptions(Options):
    title = "eager outer updates"
    outer_update: str = option("delayed", "delayed: a sync's average is applied when it lands, "
                               "--overlap steps after it started; eager: a replica's own share of "
                               "the average is applied at once and the others' share at the "
                               "fragment's next sync (Kale et al. 2025; --overlap 1 or more)",
                               ("delayed", "eager"))

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.outer_update != "eager":
            return
        if cfg.overlap == 0 and cfg.algo == "diloco":
            raise ConfigError("--outer-update eager needs an overlap, which diloco does not "
                              "have: use --algo streaming with --overlap 1 or more.")
        if cfg.overlap == 0:
            raise ConfigError("--outer-update eager needs --overlap 1 or more: with --overlap 0 "
                              "the average lands at the sync's start, where eager and delayed "
                              "are the same update.")
        if getattr(cfg, "grace", ""):
            raise ConfigError("--outer-update eager and --grace do not go together (a late "
                              "replica's share is weighed by tokens later): drop one of them.")
        if cfg.merge_weights == "tokens":
            raise ConfigError("--outer-update eager applies a replica's share at the sync's start, "
                              "before the tokens of all are known: use --merge-weights uniform.")
        if cfg.elastic:
            raise ConfigError("--outer-update eager keeps outer parameters of each replica's own, "
                              "which --elastic's heals and quorums cannot: drop one of them.")


class Eager:
    """streaming's side of --outer-update eager (module doc), mixed in before Guarding: each
    fragment's `rest` (r_m) and the outer step at a sync's start."""

    @property
    def eager(self) -> bool:
        return getattr(self.config, "outer_update", "delayed") == "eager"

    @torch.no_grad()
    def eager_start(self, f, avg) -> None:
        """At the start of f's sync (its exchange `avg` in flight): the outer step with this
        replica's own share and the rest of the last sync, then the merge."""
        c = self.config
        own = avg.sent.to(self.topo.device) / len(self.comm.membership.members)
        own = torch.where(torch.isfinite(own), own, torch.zeros_like(own))  # (no host sync)
        outer = self.outer_step(f, own if f.rest is None else own + f.rest)
        write_flat(f.params, self._gather(f, c.alpha * f.local_slice() + (1 - c.alpha) * outer))
        f.rest = -own

    def eager_landed(self, f, delta: torch.Tensor, restart: bool):
        """f's average `delta` landed (not skipped): kept for the next outer step. restart: this
        replica's weights restart from its outer parameters (returned then, else None)."""
        f.rest = delta if f.rest is None else f.rest.add_(delta)
        if not restart:
            return None
        outer = self.staging.get(f.outer, keep=False)
        write_flat(f.params, self._gather(f, outer))
        return outer

    @torch.no_grad()
    def eager_finish(self) -> None:
        """At the end (every exchange landed): the others' share of each fragment's last sync,
        in one last outer step, then the merge."""
        c = self.config
        for f in self.fragments:
            if f.rest is not None:
                outer = self.outer_step(f, f.rest)
                write_flat(f.params, self._gather(f, c.alpha * f.local_slice()
                                                  + (1 - c.alpha) * outer))
                f.rest = None

    @torch.no_grad()
    def eager_undo(self, f) -> None:
        """This replica's own share of f's sync (-f.rest: the sync has not landed yet) taken back
        at once, when it is left out or the sync is skipped: the outer step's part of it undone
        (Nesterov: m -= e, theta_outer += lr (1 + mu) e; plain SGD: theta_outer += lr e) and the
        weights moved with the outer parameters (theta += (1 - alpha) x that); r_m <- 0."""
        c, own = self.config, -f.rest
        outer = self.staging.get(f.outer)
        if c.outer_rule == "sparseloco":
            back = c.outer_lr * own
        else:
            momentum = self.staging.get(f.momentum)
            momentum.sub_(own)
            self.staging.put(f.momentum, momentum)
            back = c.outer_lr * (1 + outer_momentum_at(c, getattr(f, "outer_steps", 1) - 1)) * own
        self.staging.put(f.outer, outer.add_(back))
        write_flat(f.params, self._gather(f, f.local_slice() + (1 - c.alpha) * back))
        f.rest = torch.zeros_like(own)

    def _roll_back(self, step: int, val_loss: float, factor: float) -> None:
        super()._roll_back(step, val_loss, factor)
        for f in self.fragments:  # the syncs rolled back take their rest with them
            f.rest = None
