"""The address lowband's own servers listen on (the heal transport's, comm/heal.py)."""

from __future__ import annotations

import os


def bind_host() -> str:
    """LOWBAND_BIND_HOST, set by a launched job to its site link's address; loopback else."""
    return os.environ.get("LOWBAND_BIND_HOST", "127.0.0.1")
