"""Each replica's work in a run: the steps and tokens it trained, how much of its training time
it computed, how long it waited for the link, its --straggler factor and, with adaptive local
steps, its steps in the latest period. Sites that differ (issue 43) show here: under fixed
steps a fast replica waits for a slow one at every sync; with --local-steps adaptive it runs
more steps instead.

ReplicaWorks is a part of RunModel (it reads the model's ranks, config and the sync events'
schedule folded in by _fold_pace; calls _cached). The dashboard, the report (replicas_table)
and `lowband compare` read the same rows.
"""

from __future__ import annotations

import html
from typing import NamedTuple

from lowband.faults import parse_straggler
from lowband.options import ConfigError

from .records import _int
from .style import fmt_value


class ReplicaWork(NamedTuple):
    """One replica's work, from its ranks' step events (seconds are the mean over its ranks)."""
    replica: int
    ranks: int                 # its ranks that wrote step events
    steps: int                 # the steps it trained: its first rank's step events
    tokens: float              # the tokens its ranks trained (the step events' last, summed)
    compute_s: float           # Σ compute_s: training less the link's waits
    train_s: float             # its training seconds up to its last step (the latest elapsed_s)
    wait_s: float              # Σ (step_s - compute_s): the seconds it waited for the link
    straggler: float           # its --straggler factor (1: not named)
    period_steps: int | None   # --local-steps adaptive: its steps in the latest period
    missed: int | None         # --grace: the syncs it was late for (None: no --grace)

    @property
    def utilization(self) -> float | None:
        """Its compute seconds over its training seconds (None before a step)."""
        return self.compute_s / self.train_s if self.train_s > 0 else None


def straggler_factors(config: dict, replicas: int) -> dict[int, float]:
    """The --straggler factor of each replica the run's config names ({} when none, or when
    the config holds something the trainer would have refused)."""
    try:
        return parse_straggler(str(config.get("straggler") or ""), replicas)
    except (ConfigError, ValueError):
        return {}


def setup_text(config: dict) -> str:
    """A run's heterogeneity as its flags: "--straggler 1:2 --local-steps adaptive"; "" for
    replicas alike (no straggler, slowdown or pause; fixed local steps)."""
    parts = [f"--{name} {config[name]}" for name in ("straggler", "slowdown", "pause", "grace")
             if config.get(name)]
    if config.get("local_steps") not in (None, "", "fixed"):
        parts.append(f"--local-steps {config['local_steps']}")
    return " ".join(parts)


class ReplicaWorks:
    """RunModel's per-replica work (a mixin: reads ranks, config, n_replicas and _pace, which
    _reset empties; calls _cached)."""

    def _fold_pace(self, e: dict, replica: int) -> None:
        """A sync event's schedule (--local-steps adaptive): this replica's steps in the period
        that ended, kept from its latest sync by run step; a sync it missed (--grace)."""
        step, steps = _int(e.get("step")), _int(e.get("local_steps"))
        if e.get("missed"):
            self._missed.setdefault(replica, set()).add(step)
        if step is None or steps is None:
            return
        if step >= self._pace.get(replica, (-1, None))[0]:
            self._pace[replica] = (step, steps)

    def replica_work(self) -> list[ReplicaWork]:
        """One row per replica that took a step, in replica order."""
        return self._cached("replica_work", self._replica_work)

    def _replica_work(self) -> list[ReplicaWork]:
        by_replica: dict[int, list] = {}
        for rank, rs in sorted(self.ranks.items()):
            by_replica.setdefault(rs.replica, []).append(rs)
        factors = straggler_factors(self.config, self.n_replicas)
        graced = bool(self.config.get("grace"))
        rows = []
        for replica, ranks in sorted(by_replica.items()):
            n = len(ranks)
            rows.append(ReplicaWork(
                replica, n, ranks[0].n_steps, sum(r.tokens for r in ranks),
                sum(r.compute_s for r in ranks) / n,
                sum(r.elapsed_s if r.elapsed_s is not None else r.step_s for r in ranks) / n,
                sum(max(r.step_s - r.compute_s, 0.0) for r in ranks) / n,
                float(factors.get(replica, 1.0)), self._pace.get(replica, (None, None))[1],
                len(self._missed.get(replica, ())) if graced else None))
        return rows


# the table's columns: (heading, what a cell shows)
COLUMNS = [("replica", "the replica (its ranks when more than one)"),
           ("steps", "steps it trained"), ("tokens", "tokens its ranks trained"),
           ("compute utilization", "its compute seconds / its training seconds"),
           ("waited for the link", "Σ (step_s − compute_s), mean over its ranks"),
           ("straggler", "its --straggler factor"),
           ("steps a period", "its inner steps in the latest period (adaptive local steps)"),
           ("missed syncs", "the syncs it was late for, merged later (--grace)")]


def replicas_table(models) -> str:
    """The replicas of each run, a row each (a run's name on its first row when there are
    several runs), styled to stand alone; the steps-a-period column only where some run has
    adaptive steps, the missed-syncs one where some run has --grace. "" when no run has two replicas with a step yet (one has nothing to
    compare)."""
    runs = [(m, m.replica_work()) for m in models]
    if not any(len(rows) > 1 for _, rows in runs):
        return ""
    multi = len(models) > 1
    paced = any(r.period_steps is not None for _, rows in runs for r in rows)
    graced = any(r.missed is not None for _, rows in runs for r in rows)
    head = (["run"] if multi else []) + [h for h, _ in COLUMNS[:-2]] + (
        [COLUMNS[-2][0]] if paced else []) + ([COLUMNS[-1][0]] if graced else [])
    out = []
    for m, rows in runs:
        for i, r in enumerate(rows):
            name = ([f"<b>{html.escape(m.name)}</b>" if i == 0 else ""] if multi else [])
            cells = name + [
                f"{r.replica}" + (f" <span style='color:#888'>({r.ranks} ranks)</span>"
                                  if r.ranks > 1 else ""),
                f"{r.steps:,}", html.escape(fmt_value("tokens", r.tokens)),
                _bar(r.utilization), html.escape(fmt_value("wait_s", r.wait_s)),
                f"{r.straggler:g}×"] + (
                ["–" if r.period_steps is None else f"{r.period_steps:,}"] if paced else []) + (
                ["–" if r.missed is None else f"{r.missed:,}"] if graced else [])
            out.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    heads = "".join(f'<th title="{html.escape(dict(COLUMNS).get(h, h))}">{h}</th>'
                    for h in head)
    return (f'<table class="grid replicas lowband-replicas"><thead><tr>{heads}</tr></thead>'
            f"<tbody>{''.join(out)}</tbody></table>{STYLE}")


# the table's look where it stands alone (the dashboard); the report's grid style is the same
STYLE = ("<style>.lowband-replicas{border-collapse:collapse;font-size:12px;"
         "font-family:sans-serif;font-variant-numeric:tabular-nums}"
         ".lowband-replicas td,.lowband-replicas th{padding:2px 10px;"
         "border-bottom:1px solid #eee;text-align:right}"
         ".lowband-replicas td:first-child,.lowband-replicas th:first-child"
         "{text-align:left}</style>")


def _bar(utilization: float | None) -> str:
    """A utilization as its percentage over a small bar, so uneven replicas stand out."""
    if utilization is None:
        return "–"
    width = max(0.0, min(1.0, utilization)) * 100
    return (f"{html.escape(fmt_value('compute_utilization', utilization))} "
            "<span style='display:inline-block;width:60px;height:8px;background:#eee;"
            "vertical-align:middle'><span style='display:block;height:8px;"
            f"width:{width:.0f}%;background:#6e8cbe'></span></span>")
