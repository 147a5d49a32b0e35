"""lowband: communication-efficient distributed training of language models across slow links."""

from lowband.algorithms import register  # an algorithm from outside (algorithms/registry.py)
from lowband.config import Config, ConfigError

__version__ = "0.1.0"
__all__ = ["Config", "ConfigError", "Sync", "__version__", "compare", "launch", "register"]


def __getattr__(name):  # lowband.launch(...) without importing TorchX at `import lowband`
    import importlib

    if name == "launch":  # the module lowband.launch, callable as its launch() function
        return importlib.import_module("lowband.launch")
    if name == "compare":  # the module lowband.compare, callable as its compare() function
        return importlib.import_module("lowband.compare")
    if name == "Sync":  # your own loop with lowband's algorithms (sync/)
        return importlib.import_module("lowband.sync").Sync
    raise AttributeError(f"module 'lowband' has no attribute '{name}'")
