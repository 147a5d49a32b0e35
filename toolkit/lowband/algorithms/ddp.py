"""ddp: gradients averaged over every rank, every step (the data-parallel baseline).

Parameters are packed into buckets of about `bucket_mb` MiB in reverse registration order (the
order their gradients become ready in backward). A hook on each parameter copies its gradient
into its bucket once it has been accumulated on the last micro-batch; a full bucket is
all-reduced asynchronously at once, so communication overlaps the rest of the backward pass.
after_backward waits for every bucket and writes the averages back into the gradients. A group
of one rank (a world of one; a replica of one shard) has nothing to average: no buckets, no
hooks, no copies.

--elastic (comm/membership/elastic.py): the world is one replica group, so the buckets average
over its S ranks, and then the group's mean gradient is averaged over the groups of the current
quorum (the membership's over_groups: torchft's process group, fp32; a plain run's world holds
every group, so its fixed membership has nothing to add) and the commit vote gates the optimizer
step (a failed vote: no update this step, a `skip` event what=commit). A quorum starts every step
(should_stop, before the step reads its data): a group behind the others, restarted, receives
the model, the optimizer and the step from a live peer there and computes this step with them,
so its gradient counts like theirs.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lowband.algorithms.base import EVERY_STEP, IN_BACKWARD, Algorithm
from lowband.comm.membership.fixed import FixedMembership
from lowband.comm.sends import GRAD_BYTES, Schedule, Send
from lowband.comm.wire import wire_bytes


def pack(sizes: list[int], limit_bytes: int) -> list[list[int]]:
    """Indices of fp32 tensors of `sizes` values, in order, packed into buckets of at most
    limit_bytes (a tensor larger than that gets a bucket of its own)."""
    groups, current, size = [], [], 0
    for i, n in enumerate(sizes):
        if current and size + n * 4 > limit_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(i)
        size += n * 4
    if current:
        groups.append(current)
    return groups


def outer_wire_bytes(sizes: list[int], replicas: int, shards: int, steps: int,
                     bucket_mb: float) -> int:
    """What ddp sends over the outer link in `steps` steps, summed over ranks, computed from the
    parameters' sizes as the trainer records it: each bucket is ring all-reduced over all R x S
    ranks in rank order (2 (n - 1) / n of its bytes a rank), and R of the n ranks send to a rank
    of another replica."""
    n = replicas * shards
    if replicas < 2:
        return 0
    order = sizes[::-1]  # the order gradients become ready
    per_step = sum(2 * (n - 1) * (4 * sum(order[i] for i in g)) // n
                   for g in pack(order, int(bucket_mb * 2**20)))
    return replicas * steps * per_step


class Bucket:
    def __init__(self, params: list[torch.nn.Parameter], index: int):
        self.params, self.index = params, index
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32,
                                device=params[0].device)
        self.views, offset = {}, 0
        for p in params:
            self.views[p] = self.flat[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
        self.ready: set = set()
        self.transfer = None


class DDP(Algorithm):
    name = "ddp"
    user_loop = IN_BACKWARD  # its buckets leave during the backward pass (sync.backward)
    kind = EVERY_STEP
    elastic = True
    summary = "data-parallel baseline: gradients all-reduced over every rank every step"
    loss_fit = "ddp"

    @classmethod
    def outer_link(cls, run):
        """Buckets leave during the backward pass (its 2/3 of a step), each ring all-reduced over
        all R x S ranks; the next step's forward waits for every one. One bucket per block, or
        buckets of --bucket-mb MiB of fp32 gradients, of equal size."""
        T, grad = run.step_time, run.params * GRAD_BYTES[run.grad_dtype]
        n = run.layers if run.bucket_mb is None else math.ceil(run.params * 4 / (run.bucket_mb * 2**20))
        sends = tuple(Send(T / 3 + (k + 1) / n * 2 * T / 3,
                           wire_bytes("all_reduce", grad / n, run.world), 1) for k in range(n))
        return Schedule(T, 1, 1, (0,), (sends,))

    def __init__(self, group: str = "world"):
        self.group = group  # streaming reuses this class over its replica's inner group

    def setup(self, model, blocks, make_optimizer, topology, comm, config):
        optimizer = super().setup(model, blocks, make_optimizer, topology, comm, config)
        # the replica groups beyond this world (torchft's with --elastic, whose world is one
        # group); streaming's ddp over a replica's inner group leaves them to streaming
        self.membership = comm.membership if self.group == "world" else FixedMembership(topology)
        self.buckets = []
        if dist.get_world_size(topology.group(self.group)) == 1:
            return optimizer  # a group of one: its gradients are the average, nothing to copy
        params = [p for p in model.parameters() if p.requires_grad][::-1]
        groups = [[params[i] for i in g]
                  for g in pack([p.numel() for p in params], int(config.bucket_mb * 2**20))]
        self.buckets = [Bucket(g, i) for i, g in enumerate(groups)]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.armed = False
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        return optimizer

    def before_backward(self, step, micro, last):
        self.armed = last  # earlier micro-batches only accumulate locally

    def _grad_ready(self, p):
        if not self.armed:
            return
        bucket = self.bucket_of[p]
        bucket.views[p].copy_(p.grad)
        bucket.ready.add(p)
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket):
        bucket.transfer = self.comm.all_reduce(bucket.flat, self.group, tag=f"bucket{bucket.index}")

    def after_backward(self, step):
        self._average_buckets()
        self.membership.over_groups(self._average_groups, step)

    def _average_buckets(self):
        if not self.buckets:
            return
        for bucket in self.buckets:
            if bucket.transfer is None:  # some parameter got no gradient this step
                for p in bucket.params:
                    if p not in bucket.ready:
                        bucket.views[p].copy_(p.grad if p.grad is not None else torch.zeros_like(p))
                self._launch(bucket)
        world = dist.get_world_size(self.topo.group(self.group))
        for bucket in self.buckets:
            bucket.transfer.wait()
            bucket.flat.div_(world)
            for p in bucket.params:
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                p.grad.copy_(bucket.views[p])
            bucket.ready.clear()
            bucket.transfer = None
        self.armed = False

    # --elastic (see the module doc)
    def should_stop(self, step):
        if step >= self.config.steps:
            return True
        self.membership.begin(step)  # elastic: a group behind heals here (healed_step)
        return False

    @torch.no_grad()
    def _average_groups(self, step):
        params = [p for p in self.model.parameters() if p.requires_grad]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                          for p in params])
        # shard k of the group averages slice k over the groups; the slices meet again over
        # the group's fast link: each rank sends 1/S of the gradient over the slow one
        S, n = self.topo.shards, flat.numel()
        chunk = -(-n // S)
        piece = F.pad(flat, (0, chunk * S - n))[self.topo.shard * chunk:][:chunk]
        mean = self.membership.average(self.comm, piece, "fp32", 0, tag="grads",
                                    healed_counts=True).wait()
        if S > 1:
            mean = torch.cat(self.comm.all_gather(mean, "inner", tag="grads").wait())[:n]
        if not self.membership.commit():  # nobody steps on this gradient
            for p in params:
                p.grad = None
            self.comm.events.emit("skip", step=step + 1, what="commit")
            return
        offset = 0
        for p in params:
            p.grad = mean[offset: offset + p.numel()].view_as(p).to(p.dtype)
            offset += p.numel()
