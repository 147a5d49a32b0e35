"""The simulator against lowband's own runs on the emulated link: within 10 points of CU."""

import pytest

from lowband.plan import check_run

RUNS = {
    "ddp": ["--algo", "ddp"],
    "diloco": ["--algo", "diloco", "--sync-every", "6"],
    "streaming": ["--algo", "streaming", "--sync-every", "8", "--fragments", "2"],
}


@pytest.mark.parametrize("algo", RUNS)
def test_predicted_cu_within_10_points_of_measured(train_run, algo):
    run = train_run(*RUNS[algo], "--model", "micro", "--steps", 24, "--link-bandwidth", "100Mbit",
                    "--eval-every", 0, name=algo)
    result = check_run(run.root)
    assert abs(result["predicted_cu"] - result["measured_cu"]) <= 0.10, result
