"""benchmarks/gpu.py at tiny sizes on CPU: every section runs and reports sane rows, so the
script a GPU session relies on cannot rot in between."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow  # measured (--durations): README, Run the tests


def test_gpu_benchmark_smoke(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu.py", "--smoke", "--device", "cpu",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert "torch" in result and result["device"]

    inner = {r["loop"]: r for r in result["inner"]}
    assert set(inner) == {"plain", "lowband"}
    assert all(r["tokens_per_s"] > 0 and r["ratio_to_plain"] > 0 for r in inner.values())

    overhead = {r["algo"]: r for r in result["overhead"]}
    assert set(overhead) == {"ddp", "streaming", "streaming, outer on cpu", "edit", "acco", "zero1",
                             "streaming guard off", "ddp muon", "streaming muon",
                             "streaming guard off again", "streaming again", "ddp again"}
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in overhead.values()), overhead
    assert "the guard's cost (streaming against --guard off, 2 pair(s), alternating)" in proc.stdout

    for row in result["e2e"]:  # a Hugging Face Llama (config only) through lowband train
        assert row["ok"], row
        assert row["ran"] == row["algo"]  # the algorithm the row names, not lowband's default
        assert row["backend"] == "gloo" and row["world"] == 2 and row["comm_events"] > 0
        assert row["cuda_timed"] == 0  # CPU tensors are timed on the host
        assert row["last_loss"] < row["first_loss"] and row["steps"] == 4

    target = result["target"]  # time to target: both runs sized by the planner, their curves
    for name, run in target["runs"].items():
        assert run["ok"], run
        assert run["steps"] >= 4 and run["predicted_step_s"] > 0
        times = [p["seconds"] for p in run["curve"]]
        assert len(times) >= 2 and times == sorted(times) and run["curve"][-1]["step"] == run["steps"]
    assert target["compare"]["target_loss"] == target["runs"]["ddp"]["curve"][-1]["val_loss"]

    codecs = result["codecs"]
    assert {r["codec"] for r in codecs} >= {"int8", "fp4-e3m0", "fp4-e2m1"}
    assert all(r["equals_eager"] and r["equals_cpu"] and r["differ_cpu"] == [0, 0] for r in codecs)
    assert "[inner]" in proc.stdout and "[e2e]" in proc.stdout and "[target]" in proc.stdout
