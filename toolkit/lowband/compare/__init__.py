"""`lowband compare`: which run reaches a loss soonest, measured side by side.

    lowband compare --algos ddp,diloco,streaming -- --model mini --link-bandwidth 100Mbit
    lowband.compare(algos="ddp,streaming", model="micro", steps=40)  # the table, as a dict

Runs recipes, configs and algorithms one after another on the same `lowband train` flags, each
with the machine to itself and started as `lowband train` starts it, at an equal wall-clock
budget (default: ddp's training time for its --steps) or at equal tokens; then tables, per run,
the training time, tokens and outer-link bytes it took to reach the target validation loss
(default: ddp's final one), its validation loss at equal time, its compute utilization measured
and planned, and its tokens/s, and writes one HTML report of them all.

entries.py (what runs: the entries' configs and the comparison's identity), runner.py (running
them in a comparison directory, continuing one that stopped), table.py (the table, from the
runs' eval events), cli.py (the command line). The report's section: dashboard/comparison.py.
"""

from __future__ import annotations

import sys
import types

from lowband.compare.cli import main
from lowband.compare.runner import STEPS_CAP, CompareStopped, compare
from lowband.compare.table import evaluations, loss_at

run = compare
__all__ = ["STEPS_CAP", "CompareStopped", "compare", "evaluations", "loss_at", "main", "run"]


class _CallableModule(types.ModuleType):
    """`lowband.compare(...)` calls compare(); `lowband.compare.run` is the same function."""

    def __call__(self, *args, **kwargs) -> dict:
        return compare(*args, **kwargs)


_CallableModule.__call__.__doc__ = compare.__doc__
sys.modules[__name__].__class__ = _CallableModule
