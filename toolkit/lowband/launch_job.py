"""Old path of lowband.launch.job (launch(), components()). It goes away after one release:
import from lowband.launch.job, or from lowband.launch."""

from lowband.launch.job import components, launch  # noqa: F401

__all__ = ["components", "launch"]
