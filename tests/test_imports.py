"""The package has no import circle: every import of a lowband module by another, those inside
functions and `importlib.import_module("lowband...")` included, makes a graph with no cycle.
(The implicit import of a package's __init__ when one of its submodules is imported is left out:
it runs first and cannot close a circle unless the __init__ imports back, which is an edge.)

Run as a script (`python tests/test_imports.py [PACKAGE_DIR]`) it prints the graph's size, the
longest module and the largest circle."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "toolkit" / "lowband"


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = ["lowband", *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def edges(root: Path) -> dict[str, set[str]]:
    mods = modules(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from . import x, from .x import y
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module"
                  and node.args and isinstance(node.args[0], ast.Constant)):
                targets = [node.args[0].value]
            for t in targets:
                while t and t not in mods:  # lowband.x.name -> lowband.x
                    t = t.rpartition(".")[0]
                if t and t != name and t.startswith("lowband"):
                    graph[name].add(t)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    found = circles(edges(PACKAGE))
    assert not found, f"import circles: {found}"


def test_the_lab_is_fenced_off():
    """lowband.testing (synthetic runs, test hosts, a local Slurm cluster) is for tests, benchmarks
    and demos: nothing else in the package imports it."""
    graph = edges(PACKAGE)
    inside = [m for m in graph if m == "lowband.testing" or m.startswith("lowband.testing.")]
    assert inside, "lowband.testing is missing"
    users = {m: sorted(t for t in targets if t in inside)
             for m, targets in graph.items() if m not in inside}
    assert not {m: t for m, t in users.items() if t}


def test_the_walk_sees_lazy_imports(tmp_path):
    """The check itself: a circle closed only by an import inside a function is found."""
    pkg = tmp_path / "lowband"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from lowband import b\n")
    (pkg / "b.py").write_text("def f():\n    from lowband.a import x\n")
    assert circles(edges(pkg)) == [["lowband.a", "lowband.b"]]


# -- the house's shape (docs/architecture.md) ----------------------------------------------------

def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_files_stay_short_and_the_top_level_small():
    """No module over 450 lines, at most 18 modules at the package's top level, and train.py
    the loop alone (its run is session.py's): under 320 lines."""
    long = {m: _lines(p) for m, p in modules(PACKAGE).items() if _lines(p) > 450}
    assert not long, long
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 18, top
    assert _lines(PACKAGE / "train.py") < 320


def test_the_loops_share_the_session_not_private_names():
    """lowband.Sync and the integrations are adapters over session.Session: they import no
    private name (`_x`) of another lowband module, and nothing imports one of train.py's."""
    for folder in ("sync", "integrations"):
        for path in (PACKAGE / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lowband"):
                    private = [a.name for a in node.names if a.name.startswith("_")]
                    assert not private, (path.name, node.module, private)
    users = [m for m, targets in edges(PACKAGE).items() if "lowband.train" in targets]
    assert users == ["lowband.cli"], users  # (the command; its run is the Session's)


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else PACKAGE
    graph = edges(root)
    longest = max(modules(root).items(), key=lambda kv: len(kv[1].read_text().splitlines()))
    found = circles(graph)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports; longest "
          f"{longest[0]} ({len(longest[1].read_text().splitlines())} lines); circles: "
          f"{[len(c) for c in found]} {found}")
