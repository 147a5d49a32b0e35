"""Participation beside liveness (--elastic, issue 32): every quorum records the groups alive
(the Lighthouse's heartbeats) beside the groups that took part, and after a fault every alive
group takes part again. A group left out of one quorum used to stay out: torchft's Lighthouse
forms a quorum at once when every member of the last one asks (its fast quorum), so a slow group
met the others only to heal from them, or formed quorums of one once they had finished. The
Lighthouse now holds a quorum for every heartbeating group (half the --quorum-timeout), and a
dead one drops out when its heartbeats stop. Real processes, gloo, loopback."""

import json
import time

import pytest

from conftest import lowband
from lowband.summary import participation, sync_participation
from lowband.telemetry import read_events

pytestmark = pytest.mark.slow  # measured (--durations): README, Run the tests

pytest.importorskip("torchft")

SMALL = ["--model", "nano", "--seq-len", 32, "--batch-size", 4, "--eval-every", 0,
         "--eval-batches", 1, "--no-progress", "--link-bandwidth", "none"]


def test_after_a_restart_every_alive_group_takes_part_and_a_slow_one_stays_in_phase(tmp_path):
    """Three groups: group 1 is killed after step 3 and restarted (it heals at the sync of
    step 4), group 2 computes 300x slower, reaching each sync about 12 s after the others
    (nano's step takes about 10 ms: more than torchft's usual 10 s join timeout, with which
    group 2 fell out of phase for good; --elastic-timeout 240 makes the join timeout 120 s, room
    for a machine five times slower). Every sync has all three groups alive and taking
    part (the straggler never falls out into quorums of its own), and the records agree: each
    group's quorums are the same syncs, the members are among the alive, summary.json's
    participation is the rows'."""
    run = tmp_path / "r"
    proc = lowband("train", "--run-dir", run, *SMALL, "--algo", "diloco", "--replicas", 3,
                   "--steps", 8, "--sync-every", 4, "--elastic", "--kill", "1:3",
                   "--straggler", "2:300", "--elastic-timeout", 240, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    events = read_events(run)
    quorums = [e for e in events if e["kind"] == "quorum"]
    for e in quorums:  # every group's first rank asked the Lighthouse who is alive
        assert e["alive"] is not None and set(e["members"]) <= set(e["alive"]), e
    healed = [e for e in quorums if e["healed"]]
    assert [(e["replica"], e["step"]) for e in healed] == [(1, 4)], healed
    for g in range(3):  # the same syncs for every group (group 1: step 0 in its first life)
        assert [e["step"] for e in quorums if e["replica"] == g] == [0, 4, 8], g
    rows = sync_participation(events)
    assert [row[0] for row in rows] == [0, 4, 8], rows
    assert all(alive == took == (0, 1, 2) for _, alive, took, _ in rows), rows
    assert [healed for *_, healed in rows] == [(), (1,), ()], rows
    membership = [e for e in events if e["kind"] == "membership" and "alive" in e]
    assert membership and all(set(e["members"]) <= set(e["alive"]) for e in membership)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["elastic"]["participation"] == participation(rows) == {
        "syncs": 3, "mean_participants": 3.0, "mean_alive": 3.0, "participation": 1.0,
        "syncs_all_alive_took_part": 3}
    report = (run / "report.html").read_text()
    assert "Participation" in report and "3 of 3 syncs" in report


def test_alive_groups_are_those_heartbeating_to_the_lighthouse(monkeypatch):
    """alive_groups reads the Lighthouse's status page: every group whose heartbeat it saw
    within its timeout (a restarted group's lives have ids of their own), with the quorum's
    members; None when no Lighthouse answers."""
    from datetime import timedelta

    from torchft._torchft import LighthouseClient, LighthouseServer

    from lowband.comm.membership.lives import LIGHTHOUSE_ENV, alive_groups

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    try:
        port = server.address().rsplit(":", 1)[1]
        monkeypatch.setenv(LIGHTHOUSE_ENV, f"http://127.0.0.1:{port}")
        client = LighthouseClient(f"http://127.0.0.1:{port}", timedelta(seconds=5))
        for replica_id in ("replica0:a", "replica2:b", "replica2:c"):
            client.heartbeat(replica_id)
        assert alive_groups([]) == [0, 2]
        assert alive_groups([3]) == [0, 2, 3]
    finally:
        server.shutdown()
    # (torchft's server stops listening a moment after shutdown returns: it answered once in CI)
    deadline = time.monotonic() + 10
    while alive_groups([1]) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert alive_groups([1]) is None
