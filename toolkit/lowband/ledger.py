"""What reaching a loss took: the run's training seconds, tokens and outer-link bytes at each
evaluation.

Every `eval` event carries `elapsed_s`; an evaluation that every rank takes at the same step
(all of them but aedit's periodic ones, whose replicas are at steps of their own, and those of
--elastic runs, whose replica groups are separate jobs) also carries the run's `tokens` and
`outer_bytes` so far, the totals summary.json counts: each rank's numbers are gathered over a
process group of the trainer's own (gloo, host memory: it never waits on the algorithms'
transfers, nor they on it), at the moment the evaluation starts. summary.py's `target` reads
the records kept (Progress.evals).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Ledger:
    """Gathers the run-wide totals at an evaluation. elastic: no group (the job is one replica
    group), so evaluations carry this rank's own training seconds only."""

    def __init__(self, shards: int, elastic: bool):
        self.group = None if elastic else dist.new_group(backend="gloo")
        self.shard0 = [r % shards == 0 for r in range(dist.get_world_size())]

    def at_eval(self, step: int, val_loss: float, elapsed_s: float, tokens: int,
                outer_bytes: int, everyone: bool) -> tuple[dict, list | None]:
        """The eval event's fields and, where every rank evaluates now (`everyone`), the record
        kept for the target: [step, val_loss (mean over replicas, as summary.json's
        final_val_loss), elapsed_s (the slowest rank's training seconds, as wall_s), tokens and
        outer_bytes (summed over ranks, as tokens and outer_wire_bytes)]. Otherwise this rank's
        own training seconds and no record."""
        if self.group is None or not everyone:
            return {"elapsed_s": elapsed_s}, None
        mine = torch.tensor([float(tokens), float(outer_bytes), elapsed_s, val_loss],
                            dtype=torch.float64)
        parts = [torch.empty_like(mine) for _ in self.shard0]
        dist.all_gather(parts, mine, group=self.group)
        rows = [p.tolist() for p in parts]  # in rank order, added up as summary.py adds them
        totals = {"elapsed_s": max(r[2] for r in rows), "tokens": int(sum(r[0] for r in rows)),
                  "outer_bytes": int(sum(r[1] for r in rows))}
        vals = [r[3] for r, first in zip(rows, self.shard0) if first]
        return totals, [step, sum(vals) / len(vals), *totals.values()]
