"""lowband: communication-efficient distributed training of language models across slow links."""

from lowband.config import Config, ConfigError

__version__ = "0.1.0"
__all__ = ["Config", "ConfigError", "__version__"]
