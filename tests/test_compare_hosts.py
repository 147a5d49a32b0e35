"""`lowband compare --test-hosts`: the runs go over a real shaped link (two test hosts, network
namespaces on a veth pair shaped by tc), not the emulated one. Needs root, `ip` and `tc`."""

import json

import pytest

from conftest import lowband
from lowband.launch.hosts import TestHosts
from lowband.units import parse_bandwidth

RATE = "20Mbit"
TINY = ["--model", "nano", "--steps", "8", "--seq-len", "32", "--batch-size", "4",
        "--eval-batches", "1", "--eval-every", "4", "--link-bandwidth", RATE,
        "--link-latency", "10ms", "--sync-every", "4", "--fragments", "2", "--no-progress"]

why = TestHosts("lbc", "10.213.14", "1mbit", "128kb", "100ms").unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.root,
              pytest.mark.skipif(why is not None, reason=f"test hosts: {why}")]


def test_runs_go_over_the_test_hosts_shaped_link(tmp_path):
    proc = lowband("compare", "--algos", "ddp,streaming", "--dir", "cmp", "--test-hosts", "--",
                   *TINY, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    root = tmp_path / "cmp"
    result = json.loads((root / "compare.json").read_text())
    assert result["link"] == {"test_hosts": True, "bandwidth": "20000kbit",
                              "latency": "none added (tbf only)"}
    assert "test hosts lbc-h0, lbc-h1" in proc.stdout
    for row in result["runs"]:
        cfg = json.loads((root / row["name"] / "config.json").read_text())
        assert cfg["link_bandwidth"] == "" and cfg["replicas"] == 2  # no emulated link
        # the plan took the hosts' link: ddp's planned CU is well below 1 at 20 Mbit/s
        assert 0 < row["planned_compute_utilization"] <= 1
    ddp = {r["name"]: r for r in result["runs"]}["ddp"]
    assert ddp["planned_compute_utilization"] < 0.9
    # each rank's half of ddp's outer bytes went out through its own 20 Mbit/s veth end: the run
    # took at least that long (the emulated link is off, so only the real one can slow it)
    per_rank = ddp["outer_wire_bytes"] / 2
    assert ddp["wall_s"] >= 0.9 * per_rank * 8 / parse_bandwidth(RATE)
    # nothing of the hosts is left behind
    assert TestHosts("lbc", "10.213.14", "1mbit", "128kb", "100ms").leftovers() == []
    html = (root / "report.html").read_text(encoding="utf-8")
    assert "over test hosts joined by a real link shaped to 20000kbit" in html
