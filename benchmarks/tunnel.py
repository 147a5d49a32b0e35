"""Streaming over a 100 Mbit/s link, plain and through an encrypted tunnel (issue 35).

Two test hosts (lowband.launch.hosts: network namespaces, one veth pair shaped by tbf) and a
userspace WireGuard interface in each (lowband.testing.tunnel: wireguard-go, fresh keys, peers
set with `wg set`). The same streaming run (R=2 S=1, one group per host; the slow-link
benchmark's streaming row: recipe slow_link_streaming) runs over the plain veth addresses and
over the tunnel's, alternating in pairs (this machine is shared and noisy). Prints tokens/s and
compute utilization of each, the tunnel/plain ratios (goal: tokens/s within 10%), the bytes the
veth carried per run (the tunnel's overhead), wireguard-go's CPU seconds, and the capture: a
known fp32 tensor broadcast over gloo, once plain and once through the tunnel, recorded on the
veth; how many of 16 64-byte windows of it appear in the capture (plain: the positive
control; tunnel: goal 0).

    python benchmarks/tunnel.py [--pairs 2] [--steps 36] [--sync-every 18] [--fragments 3]
        [--model mini] [--json out.json]

Needs root, `ip`, `tc`, /dev/net/tun, `wireguard-go` and `wg`; says why not otherwise. Removes
every namespace, interface and process it made, also on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from machine import describe  # benchmarks/machine.py
from slow_link import result_of, revision, run_real  # benchmarks/slow_link.py

from lowband import recipes
from lowband.launch.hosts import TestHosts
from lowband.testing.tunnel import Capture, WireGuard, exchange, found, known_tensor, windows


def veth_bytes(hosts: TestHosts) -> int:
    """Bytes sent by both veth ends so far."""
    return sum(c["tx_bytes"] for c in hosts.counters().values())


def cpu_s(procs) -> float:
    """CPU seconds (user + system) the processes (wireguard-go's) have used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in procs:
        fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def main(argv=None) -> int:
    base = recipes.slow_link_streaming()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=base.model)
    p.add_argument("--pairs", type=int, default=2, help="plain/tunnel pairs (default 2)")
    p.add_argument("--steps", type=int, default=36)
    p.add_argument("--sync-every", type=int, default=18)
    p.add_argument("--fragments", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate-mbit", type=float, default=100.0)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if a.pairs < 1 or a.steps < 1:
        print("tunnel: --pairs and --steps must be at least 1.")
        return 2
    hosts = TestHosts("lbw", "10.213.35", f"{a.rate_mbit:g}mbit", "64kb", "50ms", host="h")
    why = hosts.unavailable() or WireGuard.unavailable()
    if why:
        print(f"tunnel: skipped: it {why}.")
        return 0
    print(describe(load=True))
    print(f"lowband {revision()}; streaming R=2 S=1, model {a.model}, {a.steps} steps, H="
          f"{a.sync_every}, P={a.fragments}, batch {a.batch_size} x {a.seq_len}, link "
          f"{a.rate_mbit:g} Mbit/s (tbf), {a.pairs} pair(s)", flush=True)
    out = Path(tempfile.mkdtemp(prefix="lowband-tunnel-"))
    rows = {"plain": [], "tunnel": []}
    wire = {"plain": [], "tunnel": []}
    wg_cpu = []  # wireguard-go's CPU seconds in each tunnel run, both hosts
    wins = windows(known_tensor())
    seen = {}
    wg = WireGuard(hosts, "10.77.35", "lbw")
    try:
        hosts.setup()
        wg.setup()
        for k in range(a.pairs):
            for link in ("plain", "tunnel") if k % 2 == 0 else ("tunnel", "plain"):
                addrs, ifaces = ((hosts.addrs, hosts.devs) if link == "plain"
                                 else (wg.addrs, wg.ifaces))
                run_dir = out / f"{link}-{k + 1}"
                b0, c0, load = veth_bytes(hosts), cpu_s(wg.procs), os.getloadavg()[0]
                run_real("streaming", a, run_dir, hosts, 29435, addrs, ifaces)
                wire[link].append(veth_bytes(hosts) - b0)
                if link == "tunnel":
                    wg_cpu.append(cpu_s(wg.procs) - c0)
                r = result_of(run_dir)
                rows[link].append(r)
                print(f"  {link:>6} #{k + 1}: {r['tokens_per_s']:8,.0f} tokens/s, compute "
                      f"{100 * r['compute_utilization']:5.1f}%, veth {wire[link][-1] / 1e6:.2f} MB,"
                      f" median compute {1000 * r['median_compute_s']:.0f} ms/step, load "
                      f"average before {load:.1f}", flush=True)
        for link, addrs, ifaces in (("plain", hosts.addrs, hosts.devs),
                                    ("tunnel", wg.addrs, wg.ifaces)):
            cap = Capture(hosts, 1, out / f"{link}.cap").start()
            exchange(hosts, addrs[0], ifaces, 29434)
            seen[link] = found(cap.stop(), wins)
    except RuntimeError as e:
        print(f"tunnel: {e}")
        return 1
    finally:
        wg.teardown()
        hosts.teardown()
    left = hosts.leftovers() + wg.leftovers()
    med = {link: {key: statistics.median(r[key] for r in rs)
                  for key in ("tokens_per_s", "compute_utilization")} for link, rs in rows.items()}
    ratio = med["tunnel"]["tokens_per_s"] / med["plain"]["tokens_per_s"]
    pairs = [t["tokens_per_s"] / q["tokens_per_s"] for t, q in zip(rows["tunnel"], rows["plain"])]
    overhead = statistics.median(wire["tunnel"]) / statistics.median(wire["plain"]) - 1
    print("\n| link | tokens/s (median) | compute util (median) | veth bytes per run (median) |")
    print("|---|---|---|---|")
    for link in rows:
        print(f"| {link} | {med[link]['tokens_per_s']:,.0f} | "
              f"{100 * med[link]['compute_utilization']:.1f}% | "
              f"{statistics.median(wire[link]) / 1e6:.2f} MB |")
    verdict = "PASS" if ratio >= 0.9 else "MISS"
    print(f"\ntunnel/plain tokens/s = {ratio:.3f} (goal >= 0.90: {verdict}; pairs "
          f"{', '.join(f'{x:.3f}' for x in pairs)})"
          f"; compute utilization {100 * med['tunnel']['compute_utilization']:.1f}% vs "
          f"{100 * med['plain']['compute_utilization']:.1f}%; the tunnel's overhead on the veth: "
          f"{100 * overhead:+.1f}% bytes")
    ns = 1e9 * statistics.median(wg_cpu) / statistics.median(wire["tunnel"])
    print(f"wireguard-go's CPU: {statistics.median(wg_cpu):.2f} s a run (both hosts; median), "
          f"{ns:.0f} ns a byte on the veth: a full {a.rate_mbit:g} Mbit/s one way would take "
          f"{ns * a.rate_mbit * 1e6 / 8 / 1e9:.2f} of a core")
    print(f"capture of a known 256 KiB fp32 tensor broadcast over gloo: {seen['plain']}/{len(wins)}"
          f" 64-byte windows found on the plain link (positive control), {seen['tunnel']}/"
          f"{len(wins)} through the tunnel "
          f"({'PASS' if seen['plain'] and not seen['tunnel'] else 'MISS'})")
    print(f"left over: {left or 'nothing'}; runs in {out}")
    if a.json:
        a.json.write_text(json.dumps({"rows": rows, "veth_bytes": wire, "median": med,
                                      "ratio": ratio, "pair_ratios": pairs, "overhead": overhead,
                                      "wireguard_cpu_s": wg_cpu,
                                      "found": seen, "windows": len(wins),
                                      "lowband": revision()}, indent=1))
    return 0 if seen["plain"] and not seen["tunnel"] and not left else 1


if __name__ == "__main__":
    sys.exit(main())
