"""EDiT's pseudo-gradient penalty: pure functions of one block's per-replica norms.

At a sync, every rank knows ||delta_i|| of every replica i for the block (delta = outer - local,
the norm taken over the whole block, all shards). From those numbers alone, and identically on
every rank, `decide` returns:

1. anomaly elimination: each norm is scored against an exponentially weighted mean and
   variance of the block's earlier norms, z_i = (||delta_i|| - mean) / std. Once the block has
   seen `warmup` syncs, a replica with z_i > `z` is flagged and contributes nothing to the
   block's average. Only large norms are anomalous. std is floored at `std_floor` x mean, so
   that the near-zero spread of the first few syncs (or of a very steady run) does not turn an
   ordinary drift of the norms into anomalies. The statistics then fold in this sync's norms in
   replica order, a flagged norm clipped to mean + z * std (so one spike barely moves them,
   while a lasting shift is absorbed over a few syncs):
       d = x - mean;  mean += rate * d;  var = (1 - rate) * (var + rate * d^2)
   (the first norm ever seen sets mean = x, var = 0). Before any norm was seen z = 0.
2. weighted averaging: over the replicas not flagged, w_i = softmax(-||delta_i|| / T), T the
   `temperature` or, when that is 0, the mean of those replicas' norms (a scale-free default).
   With `step_weights` (aedit) each weight is also multiplied by the replica's share of the
   inner steps since the last sync, then renormalized. Without `weighted`, the weights are
   uniform (times the step shares if asked). Flagged replicas weigh 0.
3. clipping: the averaged delta is scaled by min(1, `clip` / ||average||) before the outer
   step (`clip_scale`; clip 0 disables it).

All flagged (every replica anomalous on a block, e.g. R = 1): all weights are 0, the block's
outer step is skipped (outer parameters and momentum stay as they are), every replica's block
restarts from the outer parameters, and the statistics still fold in the (clipped) norms, so a
genuine lasting change of scale is learned instead of freezing the block forever.

A non-finite norm (NaN or inf in a replica's block) is always flagged, even during the warm-up
or with anomaly elimination off: averaging it in would poison the outer parameters for good.

This is the `lowband` mode (--edit-penalty lowband); penalty_reference.py holds the `reference`
mode, atorch's own computation; edit_plan.py picks one by `PenaltyConfig.mode`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class PenaltyConfig:
    anomaly: bool = True        # 1. anomaly elimination
    rate: float = 0.1           # EWMA rate
    z: float = 3.0              # z-score threshold
    warmup: int = 3             # syncs of a block before flagging acts
    std_floor: float = 0.1      # std used for z is at least this fraction of the mean
    weighted: bool = True       # 2. softmax(-norm / T) weights
    temperature: float = 0.0    # T; 0: the mean of the unflagged norms
    step_weights: bool = False  # multiply by each replica's share of steps since the last sync
    clip: float = 0.0           # 3. max norm of the averaged delta; 0: off
    mode: str = "lowband"       # or "reference": atorch's math (penalty_reference.py); or
    #                             "norm": the guard's rules (algorithms/guard.py, --guard norm)
    guard: object = None        # --guard norm: the run's config (its --guard-* thresholds)
    step_ratio: float = 0.5     # reference mode: w <- (1 - r) w + r x step share


@dataclass
class EWMA:
    """Running statistics of one block's pseudo-gradient norms."""
    mean: float = 0.0
    var: float = 0.0
    values: int = 0  # norms folded in
    syncs: int = 0   # syncs folded in

    def state(self) -> list[float]:
        return [self.mean, self.var, float(self.values), float(self.syncs)]

    @classmethod
    def from_state(cls, s) -> EWMA:
        return cls(float(s[0]), float(s[1]), int(s[2]), int(s[3]))


@dataclass
class Decision:
    z: list[float]
    flags: list[bool]
    weights: list[float]
    all_flagged: bool
    ewma: EWMA = field(default_factory=EWMA)  # the statistics after this sync
    norms: list[float] = field(default_factory=list)
    why: dict = field(default_factory=dict)  # --guard norm: why each flagged replica was


def _std(ewma: EWMA, cfg: PenaltyConfig) -> float:
    return max(math.sqrt(max(ewma.var, 0.0)), cfg.std_floor * abs(ewma.mean))


def scores(norms: list[float], ewma: EWMA, cfg: PenaltyConfig) -> tuple[list[float], list[bool]]:
    """z-scores against the statistics so far, and which replicas they flag."""
    std = _std(ewma, cfg)
    if ewma.values == 0 or std == 0:
        z = [0.0] * len(norms)
    else:
        z = [(x - ewma.mean) / std for x in norms]
    active = cfg.anomaly and ewma.syncs >= cfg.warmup
    flags = [not math.isfinite(x) or (active and zi > cfg.z) for x, zi in zip(norms, z)]
    return z, flags


def update(ewma: EWMA, norms: list[float], flags: list[bool], cfg: PenaltyConfig) -> EWMA:
    """The statistics after folding in one sync's norms (flagged ones clipped to the threshold)."""
    mean, var, n = ewma.mean, ewma.var, ewma.values
    cap = ewma.mean + cfg.z * _std(ewma, cfg)
    for x, flagged in zip(norms, flags):
        if flagged or not math.isfinite(x):
            x = cap
        if n == 0:
            mean, var = x, 0.0
        else:
            d = x - mean
            mean += cfg.rate * d
            var = (1 - cfg.rate) * (var + cfg.rate * d * d)
        n += 1
    return EWMA(mean, var, n, ewma.syncs + 1)


def weights(norms: list[float], flags: list[bool], cfg: PenaltyConfig,
            shares: list[float] | None = None) -> list[float]:
    """Each replica's weight in the block's average; all zero when every replica is flagged."""
    keep = [i for i, f in enumerate(flags) if not f]
    w = [0.0] * len(norms)
    if not keep:
        return w
    base = {i: 1.0 for i in keep}
    if cfg.step_weights and shares is not None and sum(shares[i] for i in keep) > 0:
        base = {i: float(shares[i]) for i in keep}
    if cfg.weighted:
        t = cfg.temperature
        if t <= 0:
            t = sum(norms[i] for i in keep) / len(keep)
        t = t if t > 0 else 1.0
        lo = min(norms[i] for i in keep)
        for i in keep:
            w[i] = base[i] * math.exp(-(norms[i] - lo) / t)
    else:
        for i in keep:
            w[i] = base[i]
    total = sum(w)
    return [x / total for x in w]


def decide(norms: list[float], ewma: EWMA, cfg: PenaltyConfig,
           shares: list[float] | None = None) -> Decision:
    """Flags, weights and the next statistics of one block at one sync."""
    z, flags = scores(norms, ewma, cfg)
    w = weights(norms, flags, cfg, shares)
    return Decision(z=z, flags=flags, weights=w, all_flagged=all(flags),
                    ewma=update(ewma, norms, flags, cfg), norms=list(norms))


def clip_scale(norm: float, max_norm: float) -> float:
    """Factor that brings the averaged pseudo-gradient's norm down to max_norm (1: no change)."""
    if max_norm <= 0 or not norm > max_norm:
        return 1.0
    return max_norm / norm
