"""examples/nanogpt.py, the plain training script around lowband.Sync: it trains Streaming
DiLoCo with two replicas under torchrun, its run directory is a lowband run (summary.json with
the bytes sent over the outer link, `lowband report`), and its data loader reads nanoGPT's
uint16 token files as well as text."""

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np

from lowband.launch.local import free_port
from lowband.telemetry import read_events

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "nanogpt.py"


def _example():
    spec = importlib.util.spec_from_file_location("nanogpt_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_trains_streaming_with_two_replicas_under_torchrun(tmp_path, lowband_here):
    words = "the a lowband replica fragment sync link step loss token model".split()
    rng = random.Random(0)
    (tmp_path / "corpus.txt").write_text(" ".join(rng.choice(words) for _ in range(40_000)))
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(SCRIPT),
           "--data", str(tmp_path / "corpus.txt"), "--algo", "streaming", "--steps", "16",
           "--sync-every", "4", "--fragments", "2", "--codec", "fp4-e3m0", "--batch-size", "4",
           "--seq-len", "32", "--eval-every", "8", "--link-bandwidth", "", "--run-dir", str(run)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["algorithm"] == "streaming" and summary["replicas"] == 2
    assert summary["steps_run_per_replica"] == [16, 16]
    assert summary["tokens"] == 2 * 16 * 4 * 32 and summary["outer_wire_bytes"] > 0
    steps = [e for e in read_events(run, ("step",)) if e["rank"] == 0]
    assert [e["step"] for e in steps] == list(range(1, 17))
    first, last = steps[0]["loss"], sum(e["loss"] for e in steps[-4:]) / 4
    assert last < first - 1.0, (first, last)
    evals = [e for e in read_events(run, ("eval",)) if e["rank"] == 0]
    assert [e["step"] for e in evals] == [8, 16] and evals[-1]["val_loss"] < first
    code, err = lowband_here("report", run, "-o", tmp_path / "report.html", cwd=tmp_path)
    html = (tmp_path / "report.html").read_text()
    assert code == 0 and f"\"outer_wire_bytes\": {summary['outer_wire_bytes']}" in html, err


def test_the_example_reads_nanogpts_token_files_and_text(tmp_path):
    nanogpt = _example()
    ids = np.array([7, 50256, 3, 0], dtype=np.uint16)
    ids.tofile(tmp_path / "train.bin")
    tokens, vocab = nanogpt.load(str(tmp_path / "train.bin"))
    assert tokens.tolist() == ids.tolist() and vocab == 50304
    (tmp_path / "t.txt").write_bytes("héllo".encode())
    tokens, vocab = nanogpt.load(str(tmp_path / "t.txt"))
    assert tokens.tolist() == list("héllo".encode()) and vocab == 256
