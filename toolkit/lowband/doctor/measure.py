"""The link between the nodes, measured with the run's own transport: gloo over TCP, on the
interface the run binds (GLOO_SOCKET_IFNAME, as bind_gloo sets it for a run).

For each pair (the first node and node k, one pair at a time while the others wait):
- latency: ROUNDS round trips of one value; one way is half their median;
- bandwidth each way: a first transfer of PROBE_BYTES tells roughly how fast the link is, then
  one transfer sized to take about SECONDS (between PROBE_BYTES and MAX_BYTES) is timed from
  its first byte sent to the receiver's one-value answer, less one round trip;
- several streams: the same bytes split over STREAMS process groups of the pair (each its own
  TCP connection, as concurrent transfers on separate groups are) sent at once: their
  throughput together against one stream's (1.0: the link is shared fairly and fully; below:
  throughput lost to several streams; above: one stream did not fill the link).

The record it makes is the link file `lowband plan --link FILE` reads (comm/link.py); its
bandwidth is the slowest direction of any pair, its latency the largest.
"""

from __future__ import annotations

import statistics
import time
from datetime import datetime, timezone

import torch
import torch.distributed as dist

ROUNDS = 20
STREAMS = 4
SECONDS = 1.5
PROBE_BYTES = 1 << 20
MAX_BYTES = 64 << 20


def _timed_send(peer: int, nbytes: int, group=None) -> float:
    """Send nbytes to `peer` and wait for its answer: the seconds it took."""
    buf, ack = torch.zeros(nbytes // 4), torch.zeros(1)
    start = time.perf_counter()
    dist.send(buf, peer, group=group)
    dist.recv(ack, peer)
    return time.perf_counter() - start


def _received(peer: int, nbytes: int, group=None) -> None:
    dist.recv(torch.empty(nbytes // 4), peer, group=group)
    dist.send(torch.zeros(1), peer)


def _one_way(me: int, sender: int, receiver: int, rtt: float) -> float | None:
    """Bits a second from sender to receiver (on the sender; None elsewhere)."""
    size = torch.zeros(1, dtype=torch.float64)
    if me == sender:
        seconds = _timed_send(receiver, PROBE_BYTES)
        rate = PROBE_BYTES / max(seconds - rtt, 1e-6)
        nbytes = int(min(MAX_BYTES, max(PROBE_BYTES, rate * SECONDS))) // 4 * 4
        size[0] = nbytes
        dist.send(size, receiver)
        seconds = _timed_send(receiver, nbytes)
        return 8 * nbytes / max(seconds - rtt, 1e-6)
    _received(sender, PROBE_BYTES)
    dist.recv(size, sender)
    _received(sender, int(size[0]))
    return None


def _streams(me: int, sender: int, receiver: int, nbytes: int, groups: list, rtt: float):
    """Bits a second of len(groups) streams at once from sender to receiver (on the sender)."""
    share = nbytes // len(groups) // 4 * 4
    if me == sender:
        bufs = [torch.zeros(share // 4) for _ in groups]
        start = time.perf_counter()
        works = [dist.isend(b, receiver, group=g) for b, g in zip(bufs, groups)]
        for w in works:
            w.wait()
        dist.recv(torch.zeros(1), receiver)
        return 8 * share * len(groups) / max(time.perf_counter() - start - rtt, 1e-6)
    bufs = [torch.empty(share // 4) for _ in groups]
    for w in [dist.irecv(b, sender, group=g) for b, g in zip(bufs, groups)]:
        w.wait()
    dist.send(torch.zeros(1), sender)
    return None


def _pair(me: int, k: int, groups: list) -> dict | None:
    """Node 0 and node k measure their link; the result on node 0 (None on node k)."""
    one = torch.zeros(1)
    rtts = []
    for _ in range(ROUNDS):
        if me == 0:
            start = time.perf_counter()
            dist.send(one, k)
            dist.recv(one, k)
            rtts.append(time.perf_counter() - start)
        else:
            dist.recv(one, 0)
            dist.send(one, 0)
    rtt = torch.tensor([statistics.median(rtts) if rtts else 0.0], dtype=torch.float64)
    dist.broadcast(rtt, 0, group=groups[0])  # node k subtracts the same round trip
    out_bps = _one_way(me, 0, k, float(rtt))
    back = torch.tensor([_one_way(me, k, 0, float(rtt)) or 0.0], dtype=torch.float64)
    dist.broadcast(back, k, group=groups[0])  # node k's timing of its own sending, to node 0
    nbytes = int(min(MAX_BYTES, max(PROBE_BYTES, (out_bps or 0) / 8 * SECONDS)))
    count = torch.tensor([nbytes], dtype=torch.float64)
    dist.broadcast(count, 0, group=groups[0])
    together = _streams(me, 0, k, int(count), groups, float(rtt))
    if me != 0:
        return None
    return {"latency_s": float(rtt) / 2, "out_bps": out_bps, "back_bps": float(back),
            "streams_bps": together, "bytes": nbytes}


def measure(index: int, nodes: list[dict]) -> dict | None:
    """Every pair (node 0, node k) in turn, inside the gloo world the caller started (rank =
    node index); the link record on node 0, None on the others."""
    pairs = {}
    for k in range(1, len(nodes)):
        groups = [dist.new_group([0, k]) for _ in range(STREAMS)]  # every rank makes each
        if index in (0, k):
            pairs[k] = _pair(index, k, groups)
        dist.barrier()
    if index != 0:
        return None
    return record(nodes, pairs)


def record(nodes: list[dict], pairs: dict) -> dict:
    """The link file's record (comm/link.py) from each pair's figures."""
    first, rows, together = nodes[0], [], []
    for k, p in pairs.items():
        for a, b, bps in ((first, nodes[k], p["out_bps"]), (nodes[k], first, p["back_bps"])):
            rows.append({"from": a["name"], "to": b["name"], "bandwidth_bps": bps,
                         "bytes": p["bytes"]})
        together.append(p["streams_bps"] / p["out_bps"])
    slowest = min(r["bandwidth_bps"] for r in rows)
    return {"kind": "lowband-link", "version": 1, "by": "lowband doctor",
            "measured_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "transport": "gloo over TCP",
            "nodes": [{k: n[k] for k in ("name", "address", "interface")} for n in nodes],
            "pairs": rows, "bandwidth_bps": slowest,
            "latency_s": max(p["latency_s"] for p in pairs.values()),
            "streams": {"count": STREAMS, "ratio": min(together),
                        "bandwidth_bps": min(p["streams_bps"] for p in pairs.values())}}
