"""The simulator against lowband's own runs on the emulated link: within 10 points of CU."""

import json
import re

from lowband.plan import check_run
from lowband.report import write_report

RUNS = {
    "ddp": ["--algo", "ddp"],
    "diloco": ["--algo", "diloco", "--sync-every", "6"],
    "streaming": ["--algo", "streaming", "--sync-every", "8", "--fragments", "2"],
}


def test_predicted_cu_within_10_points_of_measured(train_run, tmp_path):
    runs = [train_run(*flags, "--model", "micro", "--steps", 24, "--link-bandwidth", "100Mbit",
                      "--eval-every", 0, name=algo) for algo, flags in RUNS.items()]
    for run in runs:
        result = check_run(run.root)
        assert abs(result["predicted_cu"] - result["measured_cu"]) <= 0.10, result

    # the report draws the plan's curves with the three runs as measured points
    page = write_report([r.root for r in runs], tmp_path / "report.html").read_text()
    assert 'id="plan-section"' in page
    data = json.loads(re.search(r'Plotly.newPlot\(\s*"lowband-plan",\s*(\[.*?\]),\s*\{', page, re.S).group(1))
    assert [d["name"] for d in data if "measured" in d["name"]] == [
        f"{a} measured ({a})" for a in RUNS]
