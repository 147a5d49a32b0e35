"""The slow-link benchmark's real link: two network namespaces, a veth pair, tbf at 100 Mbit/s.

Creates the link with the helper the benchmark uses (lowband.launch.hosts), times a 2 MB TCP
transfer across it (about 0.16 s at 100 Mbit/s; milliseconds when unshaped), tears it down and checks
nothing is left. Needs root, `ip` and `tc`; skipped otherwise.
"""

import subprocess

import pytest

from lowband.launch.hosts import TestHosts


def _link(rate: str = "100mbit") -> TestHosts:
    # own names, so a benchmark running at the same time is not disturbed
    return TestHosts("lbt", "10.213.8", rate, "64kb", "50ms", host="ns")


WHY = _link().unavailable()
needs_netns = pytest.mark.skipif(WHY is not None, reason=f"network namespaces: {WHY}")


@pytest.mark.root
@needs_netns
def test_netns_link_is_throttled_and_removed():
    link = _link("100mbit")
    try:
        link.setup()
    except RuntimeError as e:  # e.g. a container without CAP_NET_ADMIN or without sch_tbf
        pytest.skip(f"cannot create network namespaces here: {e}")
    try:
        assert sorted(link.leftovers()) == ["lbt-ns0", "lbt-ns1"]
        qdisc = subprocess.run([*link.exec_prefix(0), "tc", "qdisc", "show", "dev", link.devs[0]],
                               capture_output=True, text=True, check=False).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc, qdisc
        seconds = link.measure_tcp(2_000_000, port=29398)
        # 16 Mbit at 100 Mbit/s = 0.16 s (+ ~5% of headers); loopback-speed would be ~0.002 s
        assert 0.14 <= seconds <= 0.8, seconds  # (a loaded machine: up to 0.3 s seen)
    finally:
        link.teardown()
    assert link.leftovers() == []
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout
    assert "lbt-v0" not in links and "lbt-v1" not in links


@pytest.mark.root
@needs_netns
def test_setup_removes_leftovers_of_a_crashed_run():
    link = _link()
    # a stray namespace, as a crashed run leaves it
    subprocess.run(["ip", "netns", "add", "lbt-ns0"], capture_output=True, check=False)
    try:
        link.setup()  # must not fail on the leftover
    except RuntimeError as e:
        link.teardown()
        if "lbt-ns0" in str(e):
            raise
        pytest.skip(f"cannot create network namespaces here: {e}")
    link.teardown()
    assert link.leftovers() == []
