"""EDiT's pseudo-gradient penalty as Ant Group's atorch computes it (--edit-penalty reference):
pure functions of one unit's per-replica norms, the counterpart of penalty.py (lowband's own
mode). Read in intelligent-machine-learning/dlrover @ ffbeae0f3^ (atorch/atorch/local_sgd/):
`anomaly_detection.py` (OnlineDynamicEWMA), `HSDP/_runtime_utils.py` (`_sync_sharded_params`),
`reduce_methods/base.py` and `linear.py` (LinearReducer, `_refine_weight`).

x_i is replica i's raw norm ||delta_i|| over the whole unit (aedit too: not per step).

1. Anomaly detection: one detector per (unit, replica), fed only that replica's norms (atorch:
   one per unit per rank; all ranks of a replica see the same norm). A detector holds mean (0 at
   first), M2 (0), count and the window of its last `warmup` z-scores. With the state from
   before this sync:
       is_outlier(x):  count < warmup: False
                       z = (x - mean) / std (0 where std = 0); std = sqrt(M2) once count >= 2,
                       else 0
                       outlier iff z > z_base x max(1, s), s the unbiased standard deviation of
                       the window (NaN for fewer than two values: the comparison is then false)
   then, whatever is_outlier said, update(x) (alpha = the EWMA rate):
       count += 1;  d = x - mean;  mean += alpha d;  M2 = (1 - alpha) (M2 + alpha d (x - mean))
       window <- window + [z(x)], z(x) with the new state (0 while count < warmup or std = 0)
   Two deviations: a non-finite x is always flagged and not folded in (atorch's mean and M2
   would stay NaN or inf for good); a flagged x is folded in raw, where atorch's code as written
   passes x + 1e6 (`gradnorm_value` aliases the norm it adds 1e6 to in place), which would move
   the mean by 2e4 and blind the detector for hundreds of syncs. Without anomaly detection
   nothing is folded in.
2. Weights (LinearReducer): with `weighted` (atorch's pseudo_gradnorm_reduce, softmax over the
   all-gathered norms at temperature T, 1 where `temperature` is 0, atorch's default):
       w_i = softmax_i(-(x_i + 1e6 flagged_i) / T)
   else w_i = b_i / sum_j b_j over every replica, flagged ones counted (LinearReducer's
   normalize), b_i = 1. aedit's step weights (atorch's use_step_weight) mix in each replica's
   share s_i of all replicas' steps since the start of the run (warm-up included):
   w_i <- (1 - r) w_i + r s_i (b_i = (1 - r) + r s_i in the unweighted case). A flagged
   replica's delta is zero, so its weight is 0; the others keep theirs, with no renormalization
   (the weights may sum to less than 1).
3. Clipping: the averaged delta times min(1, c / (||average|| + 1e-6)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lowband.algorithms.penalty import Decision, PenaltyConfig

FLAG_PENALTY = 1e6  # atorch adds it to a flagged replica's norm before the softmax


@dataclass
class Detector:
    """atorch's OnlineDynamicEWMA of one (unit, replica)."""
    mean: float = 0.0
    m2: float = 0.0
    count: int = 0
    window: list[float] = field(default_factory=list)  # the last `warmup` z-scores

    def std(self) -> float:
        return math.sqrt(max(self.m2, 0.0)) if self.count >= 2 else 0.0

    def z(self, x: float, warmup: int) -> float:
        std = self.std()
        return 0.0 if std == 0 or self.count < warmup else (x - self.mean) / std


@dataclass
class Detectors:
    """A unit's detectors, one per replica: its statistics in --edit-penalty reference."""
    replicas: list[Detector]

    @classmethod
    def fresh(cls, replicas: int) -> Detectors:
        return cls([Detector() for _ in range(replicas)])

    def state(self) -> list[list[float]]:
        return [[d.mean, d.m2, float(d.count), *d.window] for d in self.replicas]

    @classmethod
    def from_state(cls, s) -> Detectors:
        return cls([Detector(float(d[0]), float(d[1]), int(d[2]), [float(v) for v in d[3:]])
                    for d in s])


def sample_std(values: list[float]) -> float:
    """torch's Tensor.std(): the unbiased standard deviation, NaN for fewer than two values."""
    n = len(values)
    if n < 2:
        return math.nan
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def is_outlier(det: Detector, x: float, cfg: PenaltyConfig) -> bool:
    if not math.isfinite(x):
        return True
    if det.count < cfg.warmup:
        return False
    s = sample_std(det.window)
    threshold = cfg.z * (s if math.isnan(s) else max(1.0, s))
    return det.z(x, cfg.warmup) > threshold


def update(det: Detector, x: float, cfg: PenaltyConfig) -> Detector:
    """The detector after folding in x."""
    d = x - det.mean
    mean = det.mean + cfg.rate * d
    new = Detector(mean, (1 - cfg.rate) * (det.m2 + cfg.rate * d * (x - mean)), det.count + 1)
    window = det.window + [new.z(x, cfg.warmup)]
    new.window = window[max(len(window) - cfg.warmup, 0):]  # deque(maxlen=warmup)
    return new


def weights(norms: list[float], flags: list[bool], cfg: PenaltyConfig,
            shares: list[float] | None = None) -> list[float]:
    """Each replica's weight in the unit's weighted sum; all zero when every replica is flagged."""
    R, r = len(norms), cfg.step_ratio if cfg.step_weights and shares is not None else 0.0
    if all(flags):
        return [0.0] * R
    s = shares if r else [0.0] * R
    if cfg.weighted:
        t = cfg.temperature if cfg.temperature > 0 else 1.0
        logits = [-(x + FLAG_PENALTY * f) / t for x, f in zip(norms, flags)]
        top = max(v for v in logits if math.isfinite(v))
        e = [math.exp(v - top) if math.isfinite(v) else 0.0 for v in logits]
        w = [(1 - r) * v / sum(e) + r * si for v, si in zip(e, s)]
    else:
        base = [(1 - r) + r * si for si in s]
        divisor = sum(base)
        w = [b / (divisor if abs(divisor) >= 1e-8 else 1.0) for b in base]
    return [0.0 if f else wi for wi, f in zip(w, flags)]


def decide(norms: list[float], stats: Detectors, cfg: PenaltyConfig,
           shares: list[float] | None = None) -> Decision:
    """Flags, weights and the detectors after one sync of one unit (`shares`: aedit's
    cumulative step shares)."""
    dets = stats.replicas
    z = [d.z(x, cfg.warmup) for d, x in zip(dets, norms)]
    flags = [is_outlier(d, x, cfg) if cfg.anomaly else not math.isfinite(x)
             for d, x in zip(dets, norms)]
    after = [update(d, x, cfg) if cfg.anomaly and math.isfinite(x) else d
             for d, x in zip(dets, norms)]
    return Decision(z=z, flags=flags, weights=weights(norms, flags, cfg, shares),
                    all_flagged=all(flags), ewma=Detectors(after), norms=list(norms))


def clip_scale(norm: float, max_norm: float) -> float:
    """atorch's factor: min(1, max_norm / (norm + 1e-6)); 1 where clipping is off."""
    return 1.0 if max_norm <= 0 else min(1.0, max_norm / (norm + 1e-6))
