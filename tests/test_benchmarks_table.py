"""benchmarks/README.md's table cannot drift: every script in benchmarks/ has its row, every
row names a script that is there, every RESULTS.md section it links is a heading there, and
every test it names exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def rows() -> dict:
    """The table's rows by script: {script: [question, results, guard]}."""
    table = {}
    for line in (BENCHMARKS / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `"):
            table[cells[0].strip("`")] = cells[1:]
    return table


def slug(heading: str) -> str:
    """A Markdown heading's anchor, as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_script_has_one_row_and_every_row_a_script():
    scripts = sorted(p.name for p in BENCHMARKS.iterdir() if p.suffix in (".py", ".sh"))
    assert sorted(rows()) == scripts
    assert all(len(cells) == 3 and all(cells) for cells in rows().values()), rows()


def test_the_sections_and_tests_it_names_exist():
    assert slug("elastic on Slurm (issue 32)") == "elastic-on-slurm-issue-32"
    assert slug("your model: a Hugging Face Llama") == "your-model-a-hugging-face-llama"
    results = (BENCHMARKS / "RESULTS.md").read_text()
    anchors = {slug(h) for h in re.findall(r"^#+ (.*)$", results, re.M)}
    for script, (_, section, guard) in rows().items():
        for anchor in re.findall(r"\(RESULTS\.md#([\w-]+)\)", section):
            assert anchor in anchors, f"{script}: no section #{anchor} in RESULTS.md"
        assert section.startswith(("[", "none")), (script, section)
        for test in re.findall(r"tests/\w+\.py", guard):
            assert (ROOT / test).is_file(), f"{script}: {test} is not there"
        assert guard.startswith(("tests/", "none")), (script, guard)

