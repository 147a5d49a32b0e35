"""The pseudo-gradient penalty applied at one edit/aedit sync: from the numbers every rank
gathered, each unit's decision (flags, weights, the statistics after it), identically on every
rank, so no further message is needed. The math of one unit is in penalty.py.

The all-gather gives one row per rank, in rank order (replica i, shard k at i x S + k): its
shard's ||outer - local||^2 for every unit, then the numbers the algorithm adds (aedit: the
replica's steps since the last sync first). A replica's norm of a unit is the square root of
the sum over its S ranks. aedit's replicas do different numbers of steps, so there the penalty
scores norms per step (||delta_i|| / n_i: a replica that did more steps is not more suspicious)
and may weigh each replica by its share of the steps (--edit-step-weights).

--edit-penalty reference swaps the math for atorch's (penalty_reference.py): raw norms in aedit
too, one detector per replica, and step shares of the replicas' steps since the start of the
run (aedit's third extra number).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lowband.algorithms import penalty, penalty_reference
from lowband.algorithms.guard import judge
from lowband.algorithms.penalty import EWMA, Decision, PenaltyConfig


@dataclass
class Plan:
    decisions: list[Decision]     # one per unit
    raw_norms: list[list[float]]  # per unit, each replica's ||delta|| over the whole unit
    extras: list[list[float]]     # per replica, the numbers it added to its row


class History:
    """The guard's statistics of one block (edit and aedit with --guard norm, edit_plan.py):
    {replica: [mean log norm, syncs]}, as a flat list of floats in a checkpoint."""

    def __init__(self, by_replica: dict | None = None):
        self.by_replica = by_replica or {}

    def state(self) -> list[float]:
        return [float(x) for r, (m, n) in sorted(self.by_replica.items()) for x in (r, m, n)]

    @classmethod
    def from_state(cls, s) -> "History":
        s = [float(x) for x in s]
        return cls({int(s[i]): [s[i + 1], int(s[i + 2])] for i in range(0, len(s), 3)})


def decision_of(norms: list[float], history: History, cfg, shares: list[float] | None):
    """edit's and aedit's Decision (penalty.py) of one block by the guard's rules: the replicas
    left out weigh 0, the others equally (times their step shares with --edit-step-weights);
    `why` says why each was left out; the block's history after it (a copy)."""
    after = History({r: list(h) for r, h in history.by_replica.items()})
    v = judge([(i, n, 1.0) for i, n in enumerate(norms)], after.by_replica, cfg)
    flags = [i in v.left_out for i in range(len(norms))]
    base = [0.0 if f else (shares[i] if shares is not None else 1.0) for i, f in enumerate(flags)]
    total = sum(base)
    weights = [b / total for b in base] if total > 0 else [0.0] * len(norms)
    z = [n / math.exp(after.by_replica[i][0]) if i in after.by_replica and n > 0 else 0.0
         for i, n in enumerate(norms)]
    return Decision(z=z, flags=flags, weights=weights, all_flagged=all(flags), ewma=after,
                    norms=list(norms), why=dict(v.left_out))


def penalty_config(c, per_step: bool) -> PenaltyConfig:
    """The penalty's settings from the run's options (per_step: aedit). --guard edit (the
    default) is the penalty as --edit-* say; --guard norm the guard's rules (algorithms/guard.py:
    the replicas left out weigh 0, the others equally); --guard off leaves out only what is not
    finite."""
    guard = getattr(c, "guard", "edit")
    return PenaltyConfig(
        anomaly=c.edit_anomaly and guard != "off", rate=c.edit_ewma_rate, z=c.edit_z,
        warmup=c.edit_anomaly_warmup, weighted=c.edit_weighted, temperature=c.edit_temperature,
        step_weights=per_step and c.edit_step_weights, clip=c.edit_clip,
        mode="norm" if guard == "norm" else c.edit_penalty, step_ratio=c.edit_step_weight_ratio,
        guard=c if guard == "norm" else None)


def _reference(cfg: PenaltyConfig) -> bool:
    return cfg.mode == "reference"


def new_stats(cfg: PenaltyConfig, replicas: int):
    """A unit's statistics before its first sync: pooled (lowband), one detector a replica
    (reference), or each replica's history (norm: the guard's)."""
    if cfg.mode == "norm":
        return History()
    return penalty_reference.Detectors.fresh(replicas) if _reference(cfg) else EWMA()


def stats_from_state(cfg: PenaltyConfig, state):
    """A unit's statistics from their `state()` (a checkpoint's)."""
    if cfg.mode == "norm":
        return History.from_state(state)
    return (penalty_reference.Detectors if _reference(cfg) else EWMA).from_state(state)


def clip_scale(cfg: PenaltyConfig, norm: float) -> float:
    """The factor applied to a unit's averaged pseudo-gradient of this norm (1: no change)."""
    return (penalty_reference if _reference(cfg) else penalty).clip_scale(norm, cfg.clip)


def extras_of(rows: list[list[float]], units: int, replicas: int, shards: int) -> list[list[float]]:
    """Per replica, the numbers it added to its row after the units' squared norms."""
    return [rows[i * shards][units:] for i in range(replicas)]


def decide_sync(rows: list[list[float]], stats: list, replicas: int, shards: int,
                cfg: PenaltyConfig, per_step: bool) -> Plan:
    """Every unit's decision from the gathered rows and each unit's statistics so far."""
    extras = extras_of(rows, len(stats), replicas, shards)
    reference = _reference(cfg)
    shares = None
    if per_step:  # reference: atorch's shares of the steps since the start of the run
        steps = [e[2] if reference else e[0] for e in extras]
        shares = [s / sum(steps) if sum(steps) > 0 else 1 / replicas for s in steps]
    decisions, raw_norms = [], []
    for j, ewma in enumerate(stats):
        norms = [math.sqrt(sum(rows[i * shards + k][j] for k in range(shards)))
                 for i in range(replicas)]
        raw_norms.append(norms)
        if per_step and not reference:
            norms = [x / max(e[0], 1.0) for x, e in zip(norms, extras)]
        if cfg.mode == "norm":
            decisions.append(decision_of(norms, ewma, cfg.guard, shares))
            continue
        decisions.append((penalty_reference if reference else penalty).decide(norms, ewma, cfg,
                                                                               shares))
    return Plan(decisions, raw_norms, extras)


def event_fields(plan: Plan, j: int, replica: int, per_step: bool) -> dict:
    """What the `sync` event of unit j says about the penalty, from this replica's side."""
    d = plan.decisions[j]
    fields = dict(pseudo_grad_norm=plan.raw_norms[j][replica], weight=d.weights[replica],
                  anomaly=d.flags[replica], z=d.z[replica],
                  flagged=[i for i, f in enumerate(d.flags) if f], all_flagged=d.all_flagged)
    if per_step:
        fields["per_step_norm"] = d.norms[replica]
    return fields


def plan_state(plan: Plan) -> list[dict]:
    return [{"z": d.z, "flags": d.flags, "weights": d.weights, "norms": d.norms,
             "all_flagged": d.all_flagged, "raw_norms": raw,
             "why": {str(i): list(w) for i, w in d.why.items()}}
            for d, raw in zip(plan.decisions, plan.raw_norms)]


def plan_from_state(state: list[dict]) -> Plan:
    decisions = [Decision(z=list(p["z"]), flags=list(p["flags"]), weights=list(p["weights"]),
                          all_flagged=bool(p["all_flagged"]), norms=list(p["norms"]),
                          why={int(i): tuple(w) for i, w in p.get("why", {}).items()})
                 for p in state]
    return Plan(decisions, [list(p["raw_norms"]) for p in state], [])


def left_out(plan: Plan, j: int, cfg: PenaltyConfig) -> dict:
    """Unit j's flagged replicas and why each was left out (algorithms/guard.py's words): not
    finite, the guard's reason (--guard norm), or the penalty's z-score above --edit-z."""
    d = plan.decisions[j]
    out = {}
    for i, flagged in enumerate(d.flags):
        if not flagged:
            continue
        raw = plan.raw_norms[j][i]
        out[i] = (("non-finite", raw, math.nan) if not math.isfinite(raw) else
                  tuple(d.why[i]) if i in d.why else ("z-score", d.z[i], cfg.z))
    return out
