"""The installed wheel works without the source tree: built from a copy of the package (its
LICENSE inside), installed with its launch extra into a fresh virtual environment (CPU torch
pinned by constraints.txt), and run from an empty directory with nothing of the checkout on the
path: `lowband train` for a few steps, `lowband launch --dryrun -s slurm`, and TorchX's own
`torchx run` finding lowband's component through the `torchx.components` entry point."""

import importlib.util
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # measured (--durations): README, Run the tests

ROOT = Path(__file__).resolve().parents[1]

# asked of a subprocess: importlib.util.find_spec("pip") in this process would pass through
# setuptools' distutils shim, whose pip hook switches the shim off for the whole process, and
# torch.compile's C++ builder (tests/test_codecs_compiled.py) then fails to import setuptools
if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode:
    pytest.skip("building a wheel needs pip in the test's interpreter, and it has none",
                allow_module_level=True)


def _run(cmd: list, cwd: Path, env: dict | None = None, timeout: int = 300):
    t = time.monotonic()
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=timeout)
    print(f"{time.monotonic() - t:5.1f} s  {' '.join(map(str, cmd))[:100]}")
    assert out.returncode == 0, f"{' '.join(map(str, cmd))}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """(bin directory, environment, empty working directory) of a fresh venv holding the wheel."""
    tmp = tmp_path_factory.mktemp("wheel")
    start = time.monotonic()
    # a copy of what the wheel is built from: the build writes nothing into the checkout
    src = tmp / "src"
    shutil.copytree(ROOT / "toolkit", src / "toolkit",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-w", tmp / "dist", src],
         cwd=tmp)
    (wheel,) = (tmp / "dist").glob("lowband-*.whl")
    with zipfile.ZipFile(wheel) as z:  # the license travels in the wheel, declared in METADATA
        info = next(n.split("/")[0] for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        assert z.read(f"{info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
        assert "License-Expression: BSD-3-Clause" in z.read(f"{info}/METADATA").decode()
    # a fresh venv of the base interpreter (none of this environment's packages): the wheel and
    # its dependencies, torch the pinned CPU build, all from the package registries
    env_dir = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", env_dir], cwd=tmp)
    python = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith("LOWBAND_")}
    env["PATH"] = os.pathsep.join([str(env_dir / "bin"), env.get("PATH", "")])
    # without PYTHONPATH here too: a checkout's toolkit/ on it (its lowband.egg-info from an
    # editable install) reads to pip as lowband installed already, and the wheel is skipped
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "-c",
          ROOT / "constraints.txt", f"{wheel}[launch]"], cwd=tmp, env=env, timeout=600)
    empty = tmp / "empty"
    empty.mkdir()
    print(f"wheel built and installed in {time.monotonic() - start:.0f} s")
    return env_dir, env, empty


def test_wheel_runs_from_an_empty_directory(venv):
    env_dir, env, empty = venv
    bin_ = env_dir / "bin"
    where = _run([bin_ / "python", "-c", "import lowband, lowband.launch.component as c, torch; "
                  "print(lowband.__file__); print(c.__file__); print(torch.__version__)"],
                 cwd=empty, env=env).stdout.split()
    assert all(Path(p).is_relative_to(env_dir) for p in where[:2]), where  # the wheel's copy
    assert where[2].endswith("+cpu"), where

    train = _run([bin_ / "lowband", "train", "--algo", "ddp", "--link-bandwidth", "none",
                  "--model", "nano", "--steps", "3", "--replicas", "1",
                  "--seq-len", "32", "--batch-size", "4", "--eval-every", "0", "--eval-batches",
                  "1", "--no-progress", "--run-dir", "run"], cwd=empty, env=env)
    assert "run directory:" in train.stdout and (empty / "run" / "summary.json").is_file()

    launch = _run([bin_ / "lowband", "launch", "--dryrun", "-s", "slurm", "--replicas", "2",
                   "--shards", "2", "--", "--model", "nano", "--steps", "3"], cwd=empty, env=env)
    assert launch.stdout.count("#SBATCH --job-name=node-") == 2, launch.stdout
    assert "-m lowband.cli train --replicas 2 --shards 2" in launch.stdout

    listed = _run([bin_ / "torchx", "builtins"], cwd=empty, env=env).stdout
    assert "lowband.train" in listed and "dist.ddp" in listed, listed
    torchx = _run([bin_ / "torchx", "run", "--dryrun", "-s", "local_cwd", "lowband.train",
                   "--replicas", "1", "--", "--model", "nano"], cwd=empty, env=env)
    assert "-m lowband.cli train --replicas 1 " in torchx.stdout, torchx.stdout  # (pprinted)

    # and for real, on local_cwd: the node agent and the worker are the wheel's too
    tiny = ["--model", "nano", "--steps", "2", "--seq-len", "32", "--batch-size", "4",
            "--eval-every", "0", "--eval-batches", "1"]
    job = _run([bin_ / "lowband", "launch", "--replicas", "1", "--run-dir", "job", "--", *tiny],
               cwd=empty, env=env)
    assert "launched local_cwd://" in job.stdout and (empty / "job" / "summary.json").is_file()
    assert sorted(p.name for p in empty.iterdir()) == ["job", "run"]  # nothing else written here
