"""The machine a benchmark ran on, in one line, for its printed results and RESULTS.md."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def describe(load: bool = False) -> str:
    """CPU model, cores, kernel, Python and torch versions; with load=True the 1-minute load
    average too (benchmarks on a shared machine should say how busy it was)."""
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    text = (f"{cpu}, {os.cpu_count()} cores, Linux {platform.release()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}")
    return text + (f"; load average {os.getloadavg()[0]:.1f}" if load else "")
