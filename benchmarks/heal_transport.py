"""What lowband's heal transport (comm/membership/heal.py: a copy of the state taken in the quorum,
torch.save streamed with a MAC, torch.load(weights_only=True) after the check) costs against
torchft's own HTTP transport (no copy, no MAC, weights_only=False), both on loopback in this
process, for one state of --mib MiB (fp32 tensors of 1 MiB each, as a model's would be).

Each round sends and receives the same state through both, alternating which goes first; the
medians and their ratio print on stdout (JSON). Figures: docs/elastic.md ("Heal with weights
only"); a heal's wire time on the outer link is the state's bytes over its rate.

    python benchmarks/heal_transport.py [--mib 64] [--rounds 5]
"""

import argparse
import json
import secrets
import statistics
import time
from datetime import timedelta

import torch
from torchft.checkpointing.http_transport import HTTPTransport

from lowband.comm.membership import secret
from lowband.comm.membership.heal import HealTransport

T = timedelta(seconds=60)


def _one(sender, receiver, src_rank: int, state, step: int) -> float:
    t0 = time.perf_counter()
    sender.send_checkpoint([1], step, state, T)
    got = receiver.recv_checkpoint(src_rank, sender.metadata(), step, T)
    took = time.perf_counter() - t0
    sender.disallow_checkpoint()
    assert torch.equal(got["w0"], state["w0"])
    return took


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    state = {f"w{i}": torch.randn(256 * 1024) for i in range(a.mib)}
    key = secrets.token_bytes(32)
    members = [secret.replica_id(key, g) + ":x" for g in (0, 1)]
    quorum = lambda: (7, members)  # noqa: E731
    ours = (HealTransport(key, 0, T, quorum), HealTransport(key, 1, T, quorum))
    theirs = (HTTPTransport(T, num_chunks=0), HTTPTransport(T, num_chunks=0))
    times = {"lowband": [], "torchft": []}
    try:
        for r in range(a.rounds):
            order = [("lowband", ours), ("torchft", theirs)]
            for name, (s, rcv) in (order if r % 2 == 0 else order[::-1]):
                times[name].append(_one(s, rcv, 0, state, r + 1))
    finally:
        for t in (*ours, *theirs):
            t.shutdown(wait=False)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({"mib": a.mib, "rounds": a.rounds, "median_s": med,
                      "lowband_over_torchft": med["lowband"] / med["torchft"],
                      "all_s": times}, indent=1))


if __name__ == "__main__":
    main()
