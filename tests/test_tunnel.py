"""The encrypted outer link (issue 35): two shaped test hosts, a wireguard-go tunnel between them,
a tiny streaming run through it (only WireGuard's UDP on the link), and a capture on the veth
showing a known tensor's bytes are readable on the plain link (the positive control) and not
through the tunnel.

Needs root, `ip`, `tc`, /dev/net/tun, `wireguard-go` and `wg`; skipped with the reason if not.
"""

import os
import subprocess
import sys

import pytest

from lowband.launch.hosts import TestHosts
from lowband.testing.tunnel import (PORT, Capture, WireGuard, exchange, found, ipv4_kinds,
                                    known_tensor, windows)


def _hosts() -> TestHosts:
    # own names and subnets: the benchmark and test_slow_link may run at the same time
    return TestHosts("lbwt", "10.213.36", "100mbit", "64kb", "50ms", host="ns")


WHY = _hosts().unavailable() or WireGuard.unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.root,
              pytest.mark.skipif(WHY is not None, reason=f"encrypted test link: {WHY}")]


def _train(hosts, master, ifaces, run_dir, port):
    """Streaming on nano (two syncs a fragment), one group per host, rendezvous at `master`."""
    procs = []
    for r in range(2):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
               "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": master, "MASTER_PORT": str(port),
               "GLOO_SOCKET_IFNAME": ifaces[r]}
        cmd = [sys.executable, "-m", "lowband.cli", "train", "--algo", "streaming", "--replicas",
               "2", "--shards", "1", "--model", "nano", "--steps", "8", "--sync-every", "4",
               "--fragments", "2", "--batch-size", "2", "--seq-len", "32", "--no-progress",
               "--codec", "fp32", "--run-dir", str(run_dir)]
        procs.append(hosts.popen(r, cmd, env, run_dir.parent / f"{run_dir.name}.{r}.log"))
    for r, p in enumerate(procs):
        assert p.wait(timeout=240) == 0, (run_dir.parent / f"{run_dir.name}.{r}.log").read_text()
    assert (run_dir / "summary.json").exists()


def test_tunnel_carries_a_run_and_hides_the_bytes(tmp_path):
    hosts, wg = _hosts(), None
    try:
        try:
            hosts.setup()
        except RuntimeError as e:  # a container without CAP_NET_ADMIN or without sch_tbf
            pytest.skip(f"cannot create network namespaces here: {e}")
        wg = WireGuard(hosts, "10.77.36", "lbwt").setup()
        cap = Capture(hosts, 1, tmp_path / "run.cap").start()
        _train(hosts, wg.addrs[0], wg.ifaces, tmp_path / "run", 29436)
        kinds = ipv4_kinds(cap.stop())
        # the run's every IPv4 frame on the link was WireGuard's: none of its TCP (the store,
        # gloo) went around the tunnel
        assert set(kinds) == {f"udp {PORT}"}, kinds
        wins = windows(known_tensor())
        seen = {}
        for name, master, ifaces in (("plain", hosts.addrs[0], hosts.devs),
                                     ("tunnel", wg.addrs[0], wg.ifaces)):
            cap = Capture(hosts, 1, tmp_path / f"{name}.cap").start()
            exchange(hosts, master, ifaces, 29437 if name == "plain" else 29438)
            seen[name] = found(cap.stop(), wins)
        # positive control: on the plain link the tensor's bytes are there to read
        assert seen["plain"] >= len(wins) // 2, seen
        assert seen["tunnel"] == 0, seen
    finally:
        if wg is not None:
            wg.teardown()
        hosts.teardown()
    assert hosts.leftovers() == [] and (wg is None or wg.leftovers() == [])
    procs = subprocess.run(["pgrep", "-f", "wireguard-go -f lbwt-"], capture_output=True,
                           text=True, check=False).stdout
    assert procs == "", procs
