"""Old path of lowband.launch.cli (`lowband launch`). It goes away after one release: import
from lowband.launch.cli, or from lowband.launch."""

from lowband.launch.cli import launch_parser, main  # noqa: F401

__all__ = ["launch_parser", "main"]
