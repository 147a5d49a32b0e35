"""Old path of lowband.launch.node (the node agent, `python -m lowband.launch torchrun ARGS`).
It goes away after one release: import from lowband.launch.node, or from lowband.launch."""

from lowband.launch.node import agent  # noqa: F401

__all__ = ["agent"]
