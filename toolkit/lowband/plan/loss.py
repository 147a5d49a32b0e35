"""What published figures say about loss at equal tokens, for the planner's time to a target.

An algorithm says which figures apply to it (`Algorithm.loss_fit`, algorithms/base.py):
  "ddp"     it makes ddp's updates (zero1: the same mean gradient, sharded): no penalty.
  "diloco"  the DiLoCo family (diloco, streaming): the figures below.
  None      no published figure here (acco, edit, aedit): the planner gives their time to train
            the run's tokens, not a time to a target.

DiLoCo against data-parallel training: Charles et al., "Scaling Laws for DiLoCo" (arXiv
2503.09799), Table 4: evaluation loss of DP and of DiLoCo with M = 1, 2, 4, 8 replicas, each
trained on D = 20N tokens at H = 30, for N = 35M, 550M, 1.3B, 2.4B parameters. The ratio
DiLoCo / DP is interpolated linearly in log N, then in log2 M, and held at the table's edge
outside it (the output says so). Streaming DiLoCo is taken to lose what DiLoCo loses at the
same H: its fragments, overlap and codec add nothing here (no figure of theirs is used).

H: the paper finds loss rising with H; its H sweep is a heat-map. The shape used here is a
user's DiLoCo H sweep (2 workers, a 51M model, equal tokens, one seed: an indication, not a
paper): loss above one GPU's of 0.047 / 0.079 / 0.106 / 0.124 / 0.159 at H = 25 / 50 / 100 /
200 / 500. The penalty at H is the one at H = 30 times that excess at H over the excess at 30
(interpolated in log H, held at 25 and 500: the paper's H = 1 to 10 are worse again, not better).

Tokens to a target: near the end of a run, loss is taken to fall with tokens as the DP fit
L = 18.129 N^-0.0953 falls along runs of D = 20N tokens, i.e. as D^-0.0953. A run whose loss at
equal tokens is (1 + p) times ddp's then needs (1 + p)^(1 / 0.0953) times ddp's tokens to reach
ddp's final loss. That is an assumption; `lowband compare` measures the real factor.

Measured here: where plan/measured.py's runs (benchmarks/per_token.py: lowband's streaming and
diloco against its ddp on its GPT presets, by algorithm, inner optimizer, R and N) cover a run,
their p and tokens factor replace the figures above, and the plan says so; elsewhere the figures
stand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lowband.plan import measured

SIZES = (35e6, 550e6, 1.3e9, 2.4e9)
DP = (3.485, 2.653, 2.460, 2.326)
DILOCO = {1: (3.482, 2.645, 2.451, 2.317), 2: (3.508, 2.657, 2.464, 2.323),
          4: (3.554, 2.673, 2.472, 2.332), 8: (3.621, 2.698, 2.493, 2.351)}
H_SWEEP = ((25, 0.047), (50, 0.079), (100, 0.106), (200, 0.124), (500, 0.159))
H_FIT = 30
DATA_EXPONENT = 0.0953
FIT = ("DiLoCo scaling laws (Charles et al., arXiv 2503.09799, Table 4: N 35M-2.4B, M 1-8, "
       "H = 30), H's effect from a user's H sweep (H 25-500)")


@dataclass(frozen=True)
class Penalty:
    loss: float           # loss at equal tokens over ddp's, minus 1
    tokens_factor: float  # ddp's tokens times this reach ddp's final loss
    fit: str              # the figures used
    outside: str = ""     # where the run lies outside their range ("" inside)


def _h_excess(h: float) -> float:
    return measured.line(math.log(h), [math.log(x) for x, _ in H_SWEEP], [y for _, y in H_SWEEP],
                         hold=True)


def diloco_loss_ratio(params: float, replicas: int, sync_every: int) -> float:
    """DiLoCo's loss over DP's at equal tokens for N params, M replicas and H (above)."""
    logs = [math.log(n) for n in SIZES]
    by_m = [measured.line(math.log(params), logs, [d / p for d, p in zip(DILOCO[m], DP)],
                          hold=True) for m in sorted(DILOCO)]
    at30 = measured.line(math.log2(replicas), [math.log2(m) for m in sorted(DILOCO)], by_m,
                         hold=True)
    return 1 + (at30 - 1) * _h_excess(sync_every) / _h_excess(H_FIT)


def penalty(kind: str | None, params: float, replicas: int, sync_every: int,
            algo: str = "streaming", optimizer: str = "adamw") -> Penalty | None:
    """The loss penalty at equal tokens of algorithm `algo`, whose `loss_fit` is `kind`, with
    inner optimizer `optimizer`: measured here where that applies, else the published figures;
    None when no figure applies."""
    if kind == "ddp":
        return Penalty(0.0, 1.0, "ddp's updates")
    if kind != "diloco":
        return None
    here = measured.loss_and_factor(algo, optimizer, params, replicas, sync_every, _h_excess)
    if here is not None:
        return Penalty(*here)
    return published(params, replicas, sync_every)


def published(params: float, replicas: int, sync_every: int) -> Penalty:
    """The DiLoCo family's penalty from the published figures alone (FIT), with where the run
    lies outside their range."""
    p = diloco_loss_ratio(params, replicas, sync_every) - 1
    outside = [what for what, bad in (
        (f"N = {params:.3g} (35M-2.4B)", not SIZES[0] <= params <= SIZES[-1]),
        (f"R = {replicas} (1-8)", not 1 <= replicas <= 8),
        (f"H = {sync_every} (25-500)", not H_SWEEP[0][0] <= sync_every <= H_SWEEP[-1][0]))
        if bad]
    return Penalty(p, (1 + p) ** (1 / DATA_EXPONENT), FIT,
                   "outside the figures' range: " + ", ".join(outside) if outside else "")
