"""The registry of algorithms: one line each. The trainer builds them from here by name; the
config reads each one's option groups and defaults, the CLI its groups for --help, the
dashboard, report and planner its kind (algorithms/base.py lists what a class declares).

A new algorithm: its own file (its class, its option groups beside it), one line below, tests.
One from outside the package: `lowband.register(cls)`, an entry point of the group
`lowband.algorithms`, or the LOWBAND_ALGORITHMS variable (algorithms/registry.py).
"""
from lowband.algorithms.acco import ACCO
from lowband.algorithms.base import Algorithm
from lowband.algorithms.ddp import DDP
from lowband.algorithms.aedit import AEDiT
from lowband.algorithms.edit import EDiT
from lowband.algorithms.streaming import DiLoCo, Streaming
from lowband.algorithms.registry import ALGORITHMS, register
from lowband.algorithms.zero1 import ZeRO1

ALGORITHMS.add_builtin(DDP, DiLoCo, Streaming, ZeRO1, ACCO, EDiT, AEDiT)


def option_groups(builtin: bool = False) -> tuple:
    """Every algorithm's option groups, each once, in registry order (`builtin`: lowband's own
    only, read without loading registered ones)."""
    algorithms = ALGORITHMS.builtin if builtin else ALGORITHMS
    return tuple(dict.fromkeys(g for a in algorithms.values() for g in a.options))


def users(group) -> list[str]:
    """The algorithms that read an option group."""
    return [name for name, a in ALGORITHMS.items() if group in a.options]


__all__ = ["ALGORITHMS", "Algorithm", "option_groups", "register", "users"]
