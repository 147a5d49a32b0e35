"""An algorithm from outside the package (examples/diloco_avg.py: DiLoCo whose outer rule is
plain averaging, with an option of its own) reaches everything that reads the registry: the
flags and --help, validation, the trainer's worker processes, telemetry, the report and the
planner; a bad class is refused in one sentence, and a broken entry point is named, not raised.

The registrations that succeed happen in fresh processes (the CLI, `python -c`), as a user's
would, so this process's registry keeps lowband's own algorithms only."""

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest

from conftest import ROOT, lowband
from lowband.algorithms import ALGORITHMS, register
from lowband.algorithms.base import Algorithm
from lowband.algorithms.streaming import DiLoCo, StreamingOptions
from lowband.config import GROUPS, Config, ConfigError
from lowband.options import Options, option
from lowband.telemetry import read_events

OUTSIDE = ROOT / "examples" / "diloco_avg.py"
WITH_IT = {"LOWBAND_ALGORITHMS": str(OUTSIDE)}
RUN = ["--replicas", "2", "--model", "nano", "--steps", "12", "--sync-every", "4",
       "--eval-every", "0", "--eval-batches", "1", "--no-progress", "--link-bandwidth", "none"]


@pytest.mark.slow
def test_an_outside_algorithm_trains_with_two_replicas_and_reads_in_the_report(tmp_path):
    proc = lowband("train", "--algo", "diloco-avg", *RUN, "--run-dir", tmp_path / "avg",
                   cwd=tmp_path, env=WITH_IT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    events = read_events(tmp_path / "avg")
    syncs = [e for e in events if e["kind"] == "sync"]
    assert sorted((e["rank"], e["step"]) for e in syncs) == [(r, s) for r in (0, 1)
                                                             for s in (4, 8, 12)]
    losses = [e["loss"] for e in events if e["kind"] == "step" and e["rank"] == 0]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.5
    summary = json.loads((tmp_path / "avg" / "summary.json").read_text())
    assert summary["algorithm"] == "diloco-avg" and summary["outer_wire_bytes"] > 0

    # the reference: plain averaging is lowband's Nesterov outer step with lr 1 and momentum 0
    proc = lowband("train", "--algo", "diloco", "--outer-lr", "1", "--outer-momentum", "0", *RUN,
                   "--run-dir", tmp_path / "ref", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ref = json.loads((tmp_path / "ref" / "summary.json").read_text())
    assert summary["final_loss"] == ref["final_loss"]
    assert summary["outer_wire_bytes"] == ref["outer_wire_bytes"]

    # the report reads the run directory: no registration needed to read it
    proc = lowband("report", tmp_path / "avg", "-o", tmp_path / "x.html", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "diloco-avg" in (tmp_path / "x.html").read_text()

    # the planner plans it as the algorithm it subclasses (its bytes are diloco's)
    code = ("import json, sys; from lowband.plan.api import plan_config; "
            "cfg = json.load(open(sys.argv[1])); "
            "a, d = (plan_config({**cfg, 'algo': n}, step_time=0.05) for n in ('diloco-avg', 'diloco')); "
            "print(a['algorithm'], a['wire_bytes_per_step'] == d['wire_bytes_per_step'])")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "avg" / "config.json")],
                          capture_output=True, text=True, env={**_env(), **WITH_IT})
    assert proc.stdout.split() == ["diloco-avg", "True"], proc.stderr


def test_a_registration_in_the_users_module_reaches_the_workers(tmp_path):
    """A script imports the module that registers (no variable set): `lowband train` run from
    it starts worker processes, which import the module too (register names it for them)."""
    script = (f"import sys; sys.path.insert(0, {str(OUTSIDE.parent)!r}); import diloco_avg; "
              "from lowband.cli import main; "
              f"sys.exit(main(['train', '--algo', 'diloco-avg', *{RUN!r}, '--steps', '4', "
              f"'--sync-every', '2', '--run-dir', {str(tmp_path / 'run')!r}]))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    syncs = [e for e in read_events(tmp_path / "run") if e["kind"] == "sync"]
    assert sorted((e["rank"], e["step"]) for e in syncs) == [(0, 2), (0, 4), (1, 2), (1, 4)]


def test_its_flags_help_and_validation(tmp_path):
    proc = lowband("train", "--help", cwd=tmp_path, env=WITH_IT)
    assert proc.returncode == 0
    assert "--avg-step" in proc.stdout and "plain averaging options (--algo diloco-avg)" in proc.stdout
    assert "fragments options (--algo diloco, streaming, diloco-avg)" in proc.stdout
    assert "acco, edit, aedit, diloco-avg" in " ".join(proc.stdout.split())
    proc = lowband("train", "--algo", "diloco-avg", "--avg-step", "2", cwd=tmp_path, env=WITH_IT)
    assert proc.returncode == 2 and "--avg-step must lie in (0, 1], got 2.0." in proc.stderr
    proc = lowband("train", "--algo", "diloco", "--avg-step", "0.5", cwd=tmp_path, env=WITH_IT)
    assert proc.returncode == 2 and "--avg-step applies only to --algo diloco-avg" in proc.stderr
    proc = lowband("train", "--algo", "diloco-avg", cwd=tmp_path)  # not registered here
    assert proc.returncode == 2 and "unknown algorithm 'diloco-avg'" in proc.stderr


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != "LOWBAND_ALGORITHMS"}


def test_an_entry_point_registers_it_and_a_broken_one_is_one_sentence(tmp_path):
    """A package's metadata names the class in the group lowband.algorithms; another entry
    point of the group is broken: it is named in one sentence and the rest work."""
    info = tmp_path / "diloco_avg_pkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: diloco-avg-pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[lowband.algorithms]\n"
                                           "diloco-avg = diloco_avg:DiLoCoAvg\n"
                                           "broken = no_such_module:Thing\n")
    code = ("from lowband.config import Config; "
            "cfg = Config(algo='diloco-avg', avg_step=0.5).validate(); "
            "print(cfg.avg_step, cfg.outer_lr, Config(algo='streaming').validate().algo)")
    env = {**_env(), "PYTHONPATH": f"{tmp_path}:{OUTSIDE.parent}:{ROOT / 'toolkit'}"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    # the outer lr DiLoCo's options resolve for the default R and H (it inherits them)
    assert proc.stdout.split() == ["0.5", str(Config(algo="diloco").validate().outer_lr), "streaming"]
    assert proc.stderr.strip() == (
        "lowband: skipped entry point 'broken = no_such_module:Thing' of group lowband.algorithms "
        "(ModuleNotFoundError: No module named 'no_such_module'): fix it or remove it.")


NOTEBOOK = """
from dataclasses import dataclass
import lowband
from lowband.algorithms.streaming import DiLoCo
from lowband.config import Config
from lowband.options import Options, option
for kind, value in ((int, 1), (float, 2.5)):  # a notebook cell run twice, the knob changed
    @dataclass
    class MineOptions(Options):
        title = "mine"
        mine_knob: kind = option(value, "a knob")

    @lowband.register
    class Mine(DiLoCo):
        name = "mine"
        summary = "mine"
        options = (*DiLoCo.options, MineOptions)

    print(Config(algo="mine").validate().mine_knob)
"""


def test_a_class_defined_again_replaces_the_first(tmp_path):
    """A notebook cell run again defines the class and its option group again: no 'name
    taken', and the second definition's option is the one Config has."""
    proc = subprocess.run([sys.executable, "-c", NOTEBOOK], capture_output=True, text=True,
                          env=_env(), cwd=tmp_path)
    assert proc.stdout.split() == ["1", "2.5"], proc.stderr


@dataclass
class Clashing(Options):
    title = "clashing"
    sync_every: int = option(5, "the same name as the outer loop's, another meaning")


@dataclass
class Fine(Options):
    title = "fine"
    fine_knob: int = option(1, "a knob")


def _cls(base=DiLoCo, **attrs):
    return type("Mine", (base,), {"name": "mine", "summary": "mine", **attrs})


@pytest.mark.parametrize("cls, sentence", [
    (int, "register() takes a subclass of lowband.algorithms.Algorithm, got <class 'int'>: "
          "subclass Algorithm (or one of lowband's algorithms)."),
    (type("Mine", (DiLoCo,), {"summary": "x"}),
     "algorithm class Mine declares no `name` of its own (it would be 'diloco'): set "
     "`name = \"...\"` on the class."),
    (_cls(name="diloco"), "algorithm class Mine's name 'diloco' is taken by lowband's built-in "
                          "--algo diloco: give the class another `name`."),
    (_cls(name="My Algo"), "algorithm class Mine's name 'My Algo' is not a valid --algo value: "
                           "use lowercase letters, digits, '-' and '_'."),
    (_cls(Algorithm, kind="sometimes"), "algorithm class Mine's kind must be EVERY_STEP or "
                                        "PERIODIC (lowband.algorithms.base), got 'sometimes'."),
    (_cls(summary=""), "algorithm class Mine has no `summary`: set one line, shown by --help and "
                       "`lowband recipes`."),
    (_cls(options=[StreamingOptions]), "algorithm class Mine's `options` must be a tuple of "
     "option groups (dataclasses subclassing lowband.options.Options), got [<class "
     "'lowband.algorithms.streaming.StreamingOptions'>]."),
    (_cls(Algorithm, defaults={"fragments": 1}), "algorithm class Mine's defaults name "
     "'fragments', which none of its option groups declares: add the group that declares it "
     "to `options`."),
    (_cls(options=(*DiLoCo.options, Fine, Clashing)), "algorithm class Mine: option --sync-every "
     "of its group Clashing is already the outer loop option --sync-every (OuterOptions) of "
     "another meaning: rename it, or list OuterOptions in `options` to share it."),
], ids=["not-an-algorithm", "no-name", "name-taken", "bad-name", "kind", "summary", "options",
        "defaults", "option-clash"])
def test_a_bad_class_is_refused_in_one_sentence(cls, sentence):
    before, groups = dict(ALGORITHMS), list(GROUPS)
    with pytest.raises(ConfigError) as e:
        register(cls)
    assert str(e.value) == sentence
    assert dict(ALGORITHMS) == before and GROUPS == groups and "fine_knob" not in Config().__dict__


ELASTIC = """
import lowband
from lowband.algorithms.base import Algorithm
from lowband.config import Config, ConfigError
from lowband.flags import train_parser

@lowband.register
class Plain(Algorithm):
    name, summary = "plain", "an algorithm that does not say it runs elastic"

print(Config(algo="diloco-avg", elastic=True).validate().algo)
try:
    Config(algo="plain", elastic=True).validate()
except ConfigError as e:
    print(e)
print(" ".join(train_parser().format_help().split()).split("--elastic, --no-elastic")[1][:260])
"""


def test_an_algorithm_says_whether_it_runs_elastic():
    """`elastic` beside `kind`: one registered from outside inherits it from the lowband
    algorithm it subclasses (diloco-avg), the --elastic help names it, and one that does not
    say so is refused with --elastic in one sentence; a word other than True or False is not
    registered."""
    proc = subprocess.run([sys.executable, "-c", ELASTIC], capture_output=True, text=True,
                          env={**_env(), **WITH_IT, "COLUMNS": "400"})  # --help unwrapped
    lines = proc.stdout.splitlines()
    assert lines[0] == "diloco-avg", proc.stderr
    assert lines[1] == ("--elastic works with --algo ddp or diloco or streaming or edit or aedit "
                        "or diloco-avg for now: --algo plain cannot lose a replica group mid-run yet.")
    assert "peer (--algo ddp, diloco, streaming, edit, aedit, diloco-avg)" in lines[2]
    assert {n for n, a in ALGORITHMS.items() if a.elastic} == {"ddp", "diloco", "streaming",
                                                               "edit", "aedit"}
    with pytest.raises(ConfigError) as e:
        register(_cls(elastic="yes"))
    assert str(e.value) == ("algorithm class Mine's elastic (whether it runs --elastic) must be "
                            "True or False, got 'yes'.")
