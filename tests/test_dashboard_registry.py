"""The dashboard takes what it knows of algorithms from the registry (lowband.algorithms), and
its modules import each other in one direction."""

import ast
from pathlib import Path

import pytest

from lowband.algorithms import ALGORITHMS
from lowband.algorithms.base import EVERY_STEP, PERIODIC
from lowband.dashboard.figures import loss_spec
from lowband.dashboard.model import RunModel
from lowband.telemetry import EventWriter, RunDir, write_json_atomic

DASHBOARD = Path(__file__).resolve().parents[1] / "toolkit" / "lowband" / "dashboard"


def outer_traffic_run(root, algo: str) -> RunDir:
    """Two replicas, four steps, no sync events: outer transfers at steps 1 and 3 only."""
    rd = RunDir(root).create()
    write_json_atomic(rd.config, {"algo": algo, "replicas": 2, "shards": 1, "steps": 4})
    writers = [EventWriter(rd, r, r) for r in range(2)]
    for s in range(4):
        for r, w in enumerate(writers):
            w.emit("step", t=1000 + s + 0.5, step=s, loss=3.0, tokens=s, step_s=0.5,
                   compute_s=0.4)
            if s in (1, 3):
                w.emit("comm", t=1000 + s + 0.8, op="all_reduce", group="outer", tag="grad",
                       payload_bytes=100, wire_bytes=100, codec="fp32",
                       start=1000 + s + 0.5 + 0.01 * r, end=1000 + s + 0.8)
    for w in writers:
        w.close()
    return rd


@pytest.mark.parametrize("algo", [*ALGORITHMS, "someone-elses-algo"])
def test_outer_transfers_mark_syncs_only_for_periodic_algorithms(tmp_path, algo):
    kind = ALGORITHMS[algo].kind if algo in ALGORITHMS else PERIODIC   # unknown: periodic
    m = RunModel(outer_traffic_run(tmp_path / algo, algo).root).load()
    marks = [(mk.step, mk.label) for mk in m.sync_marks()]
    sync_line = next(t for t in loss_spec([m])[0] if t["name"] == "outer sync")
    if kind == EVERY_STEP:      # ddp, zero1, acco: their outer traffic is no sync
        assert marks == [] and sync_line["x"] == []
    else:
        assert marks == [(1, "grad"), (3, "grad")]
        assert len(sync_line["x"]) == 6          # two vertical lines


def test_every_step_algorithms_are_the_registrys():
    from lowband.dashboard.syncs import every_step

    assert {a for a in ALGORITHMS if every_step(a)} == {"ddp", "zero1", "acco"}
    assert every_step("ZeRO1") and not every_step(None) and not every_step("unknown")


def _imports(path: Path) -> set[str]:
    """The modules a dashboard file imports, relative ones as lowband.dashboard.<name>."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = "lowband.dashboard" + (f".{base}" if base else "")
            if base == "lowband.dashboard":   # from . import x: x must be a sibling module
                out |= {f"{base}.{a.name}" if (DASHBOARD / f"{a.name}.py").exists() else base
                        for a in node.names}
            else:
                out.add(base)
    return out


def test_dashboard_modules_import_siblings_never_the_package_or_the_report():
    for path in sorted(DASHBOARD.glob("*.py")):
        if path.name == "__init__.py":
            continue
        imported = _imports(path)
        assert "lowband.dashboard" not in imported, f"{path.name} imports the package __init__"
        assert "lowband.report" not in imported, f"{path.name} imports lowband.report"
