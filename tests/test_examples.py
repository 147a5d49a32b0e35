"""examples/, each script run by its line in the README's "Examples" section, small:
nanogpt.py, the plain training script around lowband.Sync, trains Streaming DiLoCo with two
replicas under torchrun, its run directory is a lowband run (summary.json with the bytes sent
over the outer link, `lowband report`), and its data loader reads nanoGPT's uint16 token files
as well as text; diloco_avg.py, an algorithm registered from outside, trains under `lowband
train` (tests/test_outside_algorithm.py tests the registration itself); hf_trainer.py, the
Hugging Face Trainer with LowbandCallback, and lightning_train.py, PyTorch Lightning with
LowbandCallback, train streaming replicas under `lowband launch`."""

import importlib.util
import json
import os
import random
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lowband.telemetry import read_events

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "nanogpt.py"


def readme_commands() -> dict:
    """The README's example lines (the code block of its "Examples" section), by the example
    each one runs: {"examples/NAME.py": [word, ...]}."""
    section = (ROOT / "README.md").read_text().split("\n## Examples\n", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [shlex.split(line) for line in block.splitlines() if line.strip()]
    return {next(w for w in words if "examples/" in w).split("=")[-1]: words for words in lines}


def run_readme_command(example: str, extra: list, cwd: Path, timeout: int):
    """Run the README's line for `example` from `cwd` as a user would from the repository root
    (its examples/ paths made absolute), with `extra` arguments appended to make it small."""
    words, env = list(readme_commands()[example]), dict(os.environ)
    while "=" in words[0]:  # VARIABLE=value before the command
        key, value = words.pop(0).split("=", 1)
        env[key] = str(ROOT / value) if value.startswith("examples/") else value
    program = {"torchrun": [sys.executable, "-m", "torch.distributed.run"],
               "lowband": [sys.executable, "-m", "lowband.cli"]}[words[0]]
    args = [str(ROOT / w) if w.startswith("examples/") else w for w in words[1:]]
    return subprocess.run(program + args + [str(a) for a in extra], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _example():
    spec = importlib.util.spec_from_file_location("nanogpt_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_example_has_its_line_in_the_readme():
    examples = sorted(f"examples/{p.name}" for p in (ROOT / "examples").glob("*.py"))
    assert sorted(readme_commands()) == examples


@pytest.mark.slow
def test_the_example_trains_streaming_with_two_replicas_under_torchrun(tmp_path, lowband_here):
    words = "the a lowband replica fragment sync link step loss token model".split()
    rng = random.Random(0)
    (tmp_path / "corpus.txt").write_text(" ".join(rng.choice(words) for _ in range(40_000)))
    run = tmp_path / "run"
    proc = run_readme_command("examples/nanogpt.py", [
        "--data", tmp_path / "corpus.txt", "--steps", "16", "--sync-every", "4", "--fragments",
        "2", "--codec", "fp4-e3m0", "--batch-size", "4", "--seq-len", "32", "--eval-every", "8",
        "--link-bandwidth", "", "--run-dir", run], cwd=tmp_path, timeout=180)
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


@pytest.mark.slow
def test_the_outside_algorithm_trains_under_lowband_train(tmp_path):
    run = tmp_path / "run"
    proc = run_readme_command("examples/diloco_avg.py", [
        "--model", "nano", "--steps", "8", "--sync-every", "4", "--eval-every", "0",
        "--eval-batches", "1", "--no-progress", "--link-bandwidth", "none", "--run-dir", run],
        cwd=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["algorithm"], summary["replicas"]) == ("diloco-avg", 2)
    assert summary["steps_run_per_replica"] == [8, 8] and summary["outer_wire_bytes"] > 0
    syncs = sorted((e["rank"], e["step"]) for e in read_events(run, ("sync",)))
    assert syncs == [(0, 4), (0, 8), (1, 4), (1, 8)]


# the framework examples: the module each needs, its arguments that make it small, the directory
# where the framework writes its own files
FRAMEWORKS = {"examples/hf_trainer.py": ("accelerate", ["--layers", "2", "--width", "64"],
                                         "hf_trainer_out"),
              "examples/lightning_train.py": ("lightning", ["--model", "nano"], "lightning_out")}


@pytest.mark.slow
@pytest.mark.parametrize("example", list(FRAMEWORKS))
def test_a_framework_example_trains_streaming_under_lowband_launch(tmp_path, example):
    pytest.importorskip("torchx")
    needs, small, output = FRAMEWORKS[example]
    pytest.importorskip(needs)
    proc = run_readme_command(example, [
        "--steps", "8", "--sync-every", "4", "--batch-size", "4", "--seq-len", "32",
        "--eval-every", "4", "--eval-batches", "2", "--lr", "3e-3", *small,
        "--link-bandwidth", ""], cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    run, = (tmp_path / "runs").iterdir()  # lowband launch's run directory, here
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["algorithm"], summary["replicas"]) == ("streaming", 2)
    assert summary["steps_run_per_replica"] == [8, 8] and summary["tokens"] == 2 * 8 * 4 * 32
    assert summary["outer_wire_bytes"] > 0
    steps = [e for e in read_events(run, ("step",)) if e["rank"] == 0]
    assert [e["step"] for e in steps] == list(range(1, 9))
    assert summary["final_loss"] < steps[0]["loss"] - 0.3, (steps[0]["loss"], summary)
    evals = [e for e in read_events(run, ("eval",)) if e["rank"] == 0]
    assert [e["step"] for e in evals] == [4, 8]
    # the framework's own files: rank 0's, in the script's --output-dir, beside the run
    assert (tmp_path / output).is_dir()


def test_the_example_reads_nanogpts_token_files_and_text(tmp_path):
    nanogpt = _example()
    ids = np.array([7, 50256, 3, 0], dtype=np.uint16)
    ids.tofile(tmp_path / "train.bin")
    tokens, vocab = nanogpt.load(str(tmp_path / "train.bin"))
    assert tokens.tolist() == ids.tolist() and vocab == 50304
    (tmp_path / "t.txt").write_bytes("héllo".encode())
    tokens, vocab = nanogpt.load(str(tmp_path / "t.txt"))
    assert tokens.tolist() == list("héllo".encode()) and vocab == 256
