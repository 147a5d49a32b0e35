"""Under torchrun the same CLI is one worker; a user's own nn.Module trains through the API."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from lowband.launch.local import free_port
from lowband.telemetry import read_events

USER_SCRIPT = textwrap.dedent('''
    import sys
    import torch, torch.nn as nn
    from lowband import Config
    from lowband.train import train

    class Mine(nn.Module):  # not lowband's GPT: blocks live in `layers`
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(256, 32)
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3))
            self.out = nn.Linear(32, 256)
        def forward(self, idx):
            x = self.emb(idx)
            for layer in self.layers:
                x = x + layer(x)
            return self.out(x)

    extra = dict(fragments=3, sync_every=3, overlap=0) if sys.argv[2] == "streaming" else {}
    cfg = Config(algo=sys.argv[2], replicas=2, steps=6, seq_len=16, batch_size=4,
                 run_dir=sys.argv[1], progress=False, link_bandwidth="", **extra)
    summary = train(cfg, model=Mine())
    if summary is not None:
        print("FINAL", summary["final_loss"])
''')


def torchrun(*args, cwd):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_cli_under_torchrun(tmp_path):
    proc = torchrun("-m", "lowband.cli", "train", "--algo", "ddp", "--link-bandwidth", "none",
                    "--model", "nano", "--steps", 4, "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1  # both ranks agreed on one run directory
    summary = json.loads((runs[0] / "summary.json").read_text())
    assert summary["replicas"] == 2 and summary["steps"] == 4
    # rank 0 ends its log with the report it wrote into the run directory
    report = runs[0].relative_to(tmp_path) / "report.html"
    assert f"report: {report}\n" in proc.stderr and (tmp_path / report).is_file()


@pytest.mark.parametrize("algo", ["ddp", "streaming"])
def test_user_module_under_torchrun(tmp_path, algo):
    (tmp_path / "mine.py").write_text(USER_SCRIPT)
    proc = torchrun("mine.py", tmp_path / "r", algo, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "FINAL" in proc.stdout
    state = torch.load(tmp_path / "r" / "model.pt", weights_only=True)
    assert "layers.2.0.weight" in state
    if algo == "streaming":  # one fragment per block of the user's ModuleList
        syncs = [e for e in read_events(tmp_path / "r", ("sync",)) if e["rank"] == 0]
        assert [e["fragment"] for e in syncs] == [0, 1, 2, 0, 1, 2]
