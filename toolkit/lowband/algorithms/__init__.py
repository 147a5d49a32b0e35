"""One file per algorithm; the trainer looks them up here by name."""
from lowband.algorithms.base import Algorithm
from lowband.algorithms.ddp import DDP
from lowband.algorithms.streaming import DiLoCo, Streaming

ALGORITHMS: dict[str, type[Algorithm]] = {"ddp": DDP, "diloco": DiLoCo, "streaming": Streaming}

__all__ = ["ALGORITHMS", "Algorithm"]
