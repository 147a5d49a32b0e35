"""The averages `Comm.average` starts (collectives.py), each a mean over a group in flight:
`Average` (an fp32 all-reduce, or the all-gather of every rank's encoded payload),
`Weighted` (--merge-weights tokens, and torchft's means: comm/membership/elastic.py),
`TwoPhase` (the all-to-all of encoded chunks, then the all-gather of the re-encoded means;
wire.py says which one a codec takes and its bytes), and `Landed`, one that has arrived.

Error of the two-phase average, per value, against the exact mean of the inputs x_i: with e(v)
the codec's worst-case error on a value v (codecs.py: int8 s/2, fp4-e2m1 s, fp4-e3m0 |v|/3 or
|v| below 2^-6 s, bf16 2^-9 |v|; s the block's scale),
  |result - mean_i x_i|  <=  mean_i e(x_i)  +  e(m),   m = mean_i decode(encode(x_i))
the first term the all-gather's own error (each rank's `sent` differs from x_i by e(x_i), which
error feedback carries into the next exchange), the second from re-encoding the mean, not fed
back, the same on every rank (every rank decodes the same encoded means). A block of m has an
absmax at most the largest absmax of the decoded x_i there, so for int8 and fp4-e2m1, whose
error is a share of the block's scale, e(m) <= max_i e(x_i) (to first order): the bound is at
most about twice the all-gather's; for fp4-e3m0 and bf16, relative to |v|, e(m) <= e(mean x_i)
(to first order). Measured (tests/test_exchange.py's inputs, R = 2..8) the mean error is about
1.4x the all-gather's.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lowband.comm.codecs import decode, encode
from lowband.comm.wire import chunk_values


def encoded(x: torch.Tensor, codec: str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the payload of x in a quantized codec, x as the receivers will decode it)."""
    payload = encoded_payload(x, codec, block)
    return payload, decode(payload, x.numel(), codec, block)


def encoded_payload(x: torch.Tensor, codec: str, block: int) -> torch.Tensor:
    """The payload of x in a quantized codec. A non-finite x cannot be encoded: it is sent as a
    payload whose first scale is NaN, so that every rank's average comes out non-finite and
    every rank skips the update alike."""
    if torch.isfinite(x).all():
        return encode(x, codec, block)
    payload = encode(torch.zeros_like(x), codec, block)
    payload[:2] = torch.tensor([float("nan")], dtype=torch.bfloat16).view(torch.uint8)
    return payload


class Average:
    """A mean over a group in flight (`transfer`: the Transfer of its all-reduce or all-gather);
    wait() returns it as a flat fp32 tensor."""

    def __init__(self, transfer, n: int, decoding, sent: torch.Tensor):
        self.transfer, self.n, self.decoding = transfer, n, decoding
        self.sent = sent  # this rank's contribution as the others will decode it

    def done(self) -> bool:
        return self.transfer.done()

    def wait(self) -> torch.Tensor:
        result = self.transfer.wait()
        if self.decoding is None:
            return result.div_(self.n)
        return decoded_sum(result, *self.decoding).div_(self.n)


class Weighted:
    """A weighted mean in flight, sum_i w_i x_i / sum_i w_i over a group's members, on one of
    two wires. Beside (`total` given: Comm's exchange, --merge-weights tokens): `transfer` is
    the mean of the w_i x_i over the n members, in any exchange (sent in the codec, so its
    scales follow the weighted values), and `total` the all-reduce of the weights; the mean is
    that times n over the summed weights, and `share` this member's weight over them. Inside
    (comm/membership/elastic.py, torchft): each member's weight travels in its own payload, so a
    member lost mid-exchange takes its weight with it: the last value of an fp32 all-reduce of
    [w x, w], or after an encoded payload of x (`decoding`: numel, codec, block, and the
    weight's bytes: one for 0 or 1, four for a float32 of tokens) whose members with weight 0
    are left out; NaN when no member had weight (the update is skipped).
    `sent` is this member's x as the others decode it, in x's units (error feedback keeps
    x - sent)."""

    def __init__(self, transfer, sent: torch.Tensor, total=None, n: int = 1,
                 weight: float | None = None, decoding=None):
        self.transfer, self.sent, self.total, self.n = transfer, sent, total, n
        self.weight, self.decoding = weight, decoding
        self.share = None  # this member's share of the summed weights, for the events (where
        # its weight was given: a uniform elastic mean's events say 1/members, elastic.py)

    def done(self) -> bool:
        return self.transfer.done() and (self.total is None or self.total.done())

    def wait(self) -> torch.Tensor:
        result = self.transfer.wait()
        if self.total is not None:
            total = float(self.total.wait()[0])
            self.share = self.weight / total if total else None
            return result.mul_(self.n / total)
        if self.decoding is None:
            weights = float(result[-1])
            if self.weight is not None:
                self.share = self.weight / weights if weights else None
            return result[:-1] / result[-1]
        numel, codec, block, size = (*self.decoding, 1)[:4]
        total, weights = torch.zeros(numel, device=self.sent.device), 0.0
        for payload in result:
            w = float(payload[-1]) if size == 1 else \
                float(payload[-size:].clone().view(torch.float32)[0])
            if w:
                total += decode(payload[:-size], numel, codec, block).mul_(w)
                weights += w
        if self.weight is not None:
            self.share = self.weight / weights if weights else None
        return total / weights if weights else torch.full_like(total, float("nan"))


class Landed:
    """An average that has already arrived (restored from a checkpoint, or drained for one):
    `committed` is the membership's commit vote taken on it then (None: not yet taken, as in a
    plain run's checkpoint from before every run had a membership); `share` this replica's
    weight in it (--merge-weights tokens; None: 1/R); `absent` the replicas that sent nothing
    (--grace; not kept in a checkpoint); `verdict` the guard's (algorithms/guard.py: who was left
    out of it; None without the guard)."""

    def __init__(self, value: torch.Tensor, committed: bool | None = None,
                 share: float | None = None, absent: list | None = None, verdict=None):
        self.value, self.committed, self.share = value, committed, share
        self.absent = absent or []
        self.verdict = verdict

    def done(self) -> bool:
        return True

    def wait(self) -> torch.Tensor:
        return self.value.clone()


def decoded_sum(payloads, numel: int, codec: str, block: int) -> torch.Tensor:
    """The fp32 sum of the values of several payloads of numel values each."""
    total = decode(payloads[0], numel, codec, block)
    for payload in payloads[1:]:
        total += decode(payload, numel, codec, block)
    return total


class TwoPhase:
    """A two-phase average in flight (wire.py's docstring): the all-to-all of encoded chunks
    starts at once, on the training thread; Comm's exchange thread waits for it, sums and
    re-encodes this rank's chunk and starts the all-gather of the means (on Comm.second_group).
    Each collective is recorded as it travels. wait() returns the mean as a flat fp32 tensor."""

    def __init__(self, comm, x: torch.Tensor, group: str, codec: str, block: int, tag: str):
        self.comm, self.group, self.codec, self.block, self.tag = comm, group, codec, block, tag
        self.n, self.numel = dist.get_world_size(comm.topo.group(group)), x.numel()
        self.pg = comm.second_group(group)  # made here, on the training thread
        self.chunk = chunk_values(self.numel, self.n, codec, block)
        chunks = F.pad(x.detach().reshape(-1), (0, self.n * self.chunk - self.numel)).view(self.n, -1)
        pieces = [encoded(c, codec, block) for c in chunks]
        self.sent = torch.cat([s for _, s in pieces])[: self.numel]  # x as the others decode it
        send = torch.stack([p for p, _ in pieces])  # row j: chunk j, for rank j
        recv = torch.empty_like(send)
        self.first = comm._start("all_to_all", group, send.numel(), lambda g: dist.all_to_all_single(
            recv, send, group=g, async_op=True), recv, tag, codec, send)
        self.result, self.error, self._done = None, None, threading.Event()
        comm.phase_two(self)

    def finish(self) -> None:
        """On the exchange thread: this rank's chunk summed and re-encoded, the means gathered."""
        try:
            recv = self.first.landed()
            if recv.is_cuda:
                torch.cuda.set_device(recv.device)
            total = decoded_sum(recv, self.chunk, self.codec, self.block)
            mean = encoded_payload(total.div_(self.n), self.codec, self.block)
            means = torch.empty(self.n * mean.numel(), dtype=torch.uint8, device=mean.device)
            gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # torch < 2.13
            second = self.comm.run("all_gather", self.comm.link_of(self.group), self.n, mean.numel(),
                                   lambda: gather(means, mean, group=self.pg, async_op=True), means,
                                   self.tag, self.codec, mean)
            rows = second.landed().view(self.n, -1)
            self.result = torch.cat([decode(r, self.chunk, self.codec, self.block)
                                     for r in rows])[: self.numel]
        except Exception as e:  # handed to the training thread by wait()
            self.error = e
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        self._done.wait()
        self.comm.wait_s += time.perf_counter() - t0
        if self.error is not None:
            raise self.error
        return self.result
