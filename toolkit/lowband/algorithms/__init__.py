"""One file per algorithm; the trainer looks them up here by name."""
from lowband.algorithms.base import Algorithm
from lowband.algorithms.ddp import DDP
from lowband.algorithms.edit import AEDiT, EDiT
from lowband.algorithms.acco import ACCO
from lowband.algorithms.streaming import DiLoCo, Streaming
from lowband.algorithms.zero1 import ZeRO1

ALGORITHMS: dict[str, type[Algorithm]] = {"ddp": DDP, "diloco": DiLoCo, "streaming": Streaming,
                                        "zero1": ZeRO1, "acco": ACCO, "edit": EDiT, "aedit": AEDiT}

__all__ = ["ALGORITHMS", "Algorithm"]
