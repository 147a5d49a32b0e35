"""The chaos harness's short soak (lowband/testing/chaos.py; benchmarks/chaos.py soaks ten
minutes): 8 elastic replica groups of nano on loopback for about a minute, a random group
SIGKILLed about every 15 s from outside and the Lighthouse killed once (the launcher starts a
new one). From the run's own records: no state from a group that had not trained, equal outer
parameters in every sync and at the end, every step's tokens counted once, no quorum wait past
--quorum-timeout. (The loss against a run without failures at equal tokens, invariant 5, is
the benchmark's: a second run of eight groups would double this test's minute.)"""

import pytest

from lowband.testing.chaos import Soak, check, train_argv

pytest.importorskip("torchft")

STEPS, QUORUM_TIMEOUT = 240, 30


def test_eight_groups_under_kills_and_a_lighthouse_restart_keep_the_invariants(tmp_path):
    soak = Soak(train_argv(tmp_path / "chaos", STEPS, quorum_timeout=QUORUM_TIMEOUT), seed=32,
                kill_every=15, first_kill=4, lighthouse_at=9, timeout=400).run()
    assert soak.returncode == 0, soak.output[-3000:]
    kinds = [f.what for f in soak.faults]
    assert kinds.count("lighthouse") == 1 and kinds.count("group") >= 1, soak.faults
    report = check(tmp_path / "chaos", QUORUM_TIMEOUT, soak.faults)
    assert report.failures == [], "\n".join(report.failures)
    assert set(report.passed) == {"1 heal source", "2 equal state", "3 tokens once",
                                  "4 bounded wait"}
    figures = report.figures
    # (a group killed while it starts again, before its run event, restarts once for both)
    assert figures["lighthouse_restarts"] == 1 and 1 <= figures["restarts"] <= kinds.count("group")
    assert figures["syncs"] > 0 and 1 <= figures["mean_participants"] <= 8

