"""(a helper) A benchmark's goals printed as PASS/MISS lines, and its raw results written as
JSON beside its arguments (heterogeneity.py, grace.py)."""

from __future__ import annotations

import json
from pathlib import Path


def report(title: str, checked: list[tuple[str, bool | None, str]], args,
           path: Path | None, **results) -> None:
    """Print `checked` (what, ok: True PASS, False MISS, None a figure only, detail) under
    `title`; with `path`, write {"args": args' flags, **results, "goals": checked} there."""
    print(f"\n{title}:")
    for what, ok, detail in checked:
        print(f"  {'PASS' if ok else 'MISS' if ok is False else '    '}  {what}: {detail}")
    if path:
        path.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                    **results, "goals": checked}, indent=1))
