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


def reference_replicas(R: int, S: int, n_layer: int, seq: int, batch: int, lr: float, seed: int):
    """The float64 references' common start: R copies of lowband's GPT from one seeded
    initialisation, the R*S ranks' batches, and one AdamW per replica with the trainer's groups
    (weight decay 0.1 on matrices only, betas 0.9/0.95). Returns (init, models, data, opts)."""
    import torch

    from lowband.data import Batches, load_tokens
    from lowband.model import GPT, gpt_config

    torch.manual_seed(seed)
    mc = gpt_config("nano", n_layer=n_layer, seq_len=seq)
    init = GPT(mc).double()
    models = [GPT(mc).double() for _ in range(R)]
    for m in models:
        m.load_state_dict(init.state_dict())
    tokens = load_tokens("builtin")
    data = [Batches(tokens, rank=r, world=R * S, seq_len=seq, batch_size=batch, seed=seed,
                    val_fraction=0.02) for r in range(R * S)]
    opts = []
    for m in models:
        ps = list(m.parameters())
        opts.append(torch.optim.AdamW([{"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
                                       {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}],
                                      lr=lr, betas=(0.9, 0.95)))
    return init, models, data, opts
