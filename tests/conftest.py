import os
import subprocess
import sys
from pathlib import Path

import pytest

from lowband.telemetry import RunDir

ROOT = Path(__file__).resolve().parents[1]


def lowband(*args, cwd=None, timeout=300, env=None) -> subprocess.CompletedProcess:
    """Run the `lowband` CLI as a user would, in a fresh process."""
    return subprocess.run([sys.executable, "-m", "lowband.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture
def train_run(tmp_path):
    """Run `lowband train` with the given flags into a fresh run directory; fail loudly."""

    def run(*args, name="run"):
        run_dir = tmp_path / name
        proc = lowband("train", "--no-progress", "--run-dir", run_dir, *args, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return RunDir(run_dir)

    return run
