"""lowband: communication-efficient distributed training of language models across slow links."""

from lowband.algorithms import register  # an algorithm from outside (algorithms/registry.py)
from lowband.config import Config, ConfigError

__version__ = "0.1.0"
__all__ = ["Config", "ConfigError", "__version__", "launch", "register"]


def __getattr__(name):  # lowband.launch(...) without importing TorchX at `import lowband`
    if name == "launch":  # the module lowband.launch, callable as its launch() function
        import importlib

        return importlib.import_module("lowband.launch")
    raise AttributeError(f"module 'lowband' has no attribute '{name}'")
