"""The loss streaming pays at equal tokens as measured here, for the planner where it applies.

benchmarks/per_token.py ran lowband's ddp for S steps and today's streaming (P=4, tau=1,
fp4-e3m0, H=20) for S, 1.5 S and 2 S steps (each its own full schedule), the same seed and data,
on lowband's GPT presets, and diloco (H=20) so at R=2. MEASURED holds, per (algorithm, inner
optimizer, R), each model's (N, p, factor): p = the algorithm's final validation loss at S
steps over ddp's, minus 1, and factor = the tokens it needs to reach ddp's final loss over
ddp's (where its runs' final losses cross ddp's, log-log between the two that bracket it).

Where it applies: the run's algorithm and inner optimizer measured, R within the R measured
for them (linear in log2 R between them), N within the sizes measured (p and ln(factor) linear
in log N between them; with one size, that size within 10%), and H within [H/2, 2H] of the
measured H (p scaled by the published H shape, plan/loss.py, and the factor with it, at the
exponent ln(factor) / ln(1 + p) measured). Elsewhere the published figures stand; the plan
names which it used. The runs are short (S = 300 steps: 0.6M tokens at R=2, 5 tokens a
parameter for nano and 0.13 for mini, against the published fits' 20), so the factor is a
short-run factor; benchmarks/RESULTS.md "per token" has the runs and how it moved with N.
"""

from __future__ import annotations

import math

H = 20
STEPS = 300
# (algorithm, inner optimizer, R) -> ((N, p, factor), ...) by N; per_token.py --plan prints it
MEASURED: dict[tuple[str, str, int], tuple[tuple[int, float, float], ...]] = {
    ('diloco', 'adamw', 2): (
        (123200, 0.05447, 1.4990),
        (836736, 0.08341, 1.7466),
    ),
    ('diloco', 'muon', 2): (
        (123200, 0.01536, 1.1076),
        (836736, 0.03009, 1.1385),
    ),
    ('streaming', 'adamw', 2): (
        (123200, 0.02586, 1.1704),
        (836736, 0.06927, 1.4607),
        (4820224, 0.02825, 1.2550),
    ),
    ('streaming', 'adamw', 4): (
        (123200, 0.04561, 1.3609),
        (836736, 0.05667, 1.3018),
        (4820224, 0.13138, 2.1931),
    ),
    ('streaming', 'muon', 2): (
        (123200, 0.00402, 1.0328),
        (836736, 0.02187, 1.0868),
        (4820224, 0.10454, 1.2493),
    ),
    ('streaming', 'muon', 4): (
        (123200, 0.02165, 1.1857),
        (836736, 0.08094, 1.3344),
    ),
}
SOURCE = "benchmarks/per_token.py, 2026-11-29"


def line(x: float, xs: list[float], ys: list[float], hold: bool = False) -> float | None:
    """Piecewise linear through (xs, ys) (xs ascending); outside [xs[0], xs[-1]] held at the
    nearer end with hold, else None (plan/loss.py holds the published figures' ends)."""
    if not xs:
        return None
    if x < xs[0] or x > xs[-1]:
        return (ys[0] if x < xs[0] else ys[-1]) if hold else None
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


def _at(points, params: float) -> tuple[float, float] | None:
    """(p, ln factor) at N = params from one (algorithm, optimizer, R)'s points; None outside
    their sizes."""
    if len(points) == 1:
        n, p, factor = points[0]
        return (p, math.log(factor)) if abs(params / n - 1) <= 0.1 else None
    logs = [math.log(n) for n, _, _ in points]
    p = line(math.log(params), logs, [p for _, p, _ in points])
    ln_f = line(math.log(params), logs, [math.log(f) for _, _, f in points])
    return None if p is None else (p, ln_f)


def loss_and_factor(algo: str, optimizer: str, params: float, replicas: int, sync_every: int,
                    h_excess) -> tuple[float, float, str] | None:
    """(p, tokens factor, what it rests on) where the measurements apply, else None. h_excess:
    the published H shape (plan/loss.py), p scaled by h_excess(H) / h_excess(measured H)."""
    if not H / 2 <= sync_every <= 2 * H:
        return None
    rs = sorted(r for a, o, r in MEASURED if (a, o) == (algo, optimizer))
    if not rs or not rs[0] <= replicas <= rs[-1]:
        return None
    lo = max(r for r in rs if r <= replicas)
    hi = min(r for r in rs if r >= replicas)
    at = [_at(MEASURED[algo, optimizer, r], params) for r in (lo, hi)]
    if None in at:
        return None
    w = 0.0 if hi == lo else math.log2(replicas / lo) / math.log2(hi / lo)
    p, ln_f = ((1 - w) * a + w * b for a, b in zip(*at))
    scaled = p * h_excess(sync_every) / h_excess(H)
    if p > 0 and ln_f > 0:  # the factor follows p at the exponent measured
        ln_f *= math.log1p(scaled) / math.log1p(p)
    p = scaled
    sizes = sorted({n for a, o, r in MEASURED if (a, o) == (algo, optimizer)
                    for n, _, _ in MEASURED[a, o, r]})
    what = (f"lowband's own measurement ({SOURCE}: {algo} against ddp, "
            f"{optimizer} inner, N {sizes[0] / 1e6:.2g}M-{sizes[-1] / 1e6:.2g}M, "
            f"R {rs[0]}{f'-{rs[-1]}' if rs[-1] != rs[0] else ''}"
            f", H {H}, {STEPS} steps; H other than {H} by the published H shape)")
    return p, math.exp(ln_f), what
