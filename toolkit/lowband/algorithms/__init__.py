"""One file per algorithm; the trainer looks them up here by name."""
from lowband.algorithms.base import Algorithm
from lowband.algorithms.ddp import DDP

ALGORITHMS: dict[str, type[Algorithm]] = {"ddp": DDP}

__all__ = ["ALGORITHMS", "Algorithm"]
