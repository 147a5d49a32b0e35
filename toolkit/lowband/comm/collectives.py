"""Asynchronous collectives that record every transfer.

Every byte an algorithm moves between ranks goes through `Comm`. Each call starts the collective
asynchronously and returns a `Transfer` handle; when the collective completes (a callback on its
future, so `end` is when the bytes arrived, not when somebody waited) a `comm` event is written
with the payload bytes, the bytes this rank put on the wire, and start/end times. `wait()` counts
the seconds the caller was blocked, which the trainer subtracts from the step to get compute time.

On the outer link an emulated `Link` (link.py) may delay completion: `end` then includes it, and
the event also carries `begin`, when the link started transmitting (after the FIFO queue).
With CUDA tensors the host learns of a collective's end early or late (NCCL's future completes
when the work is queued), so `start` and `end` come from CUDA events instead (`GpuClock`): start
when the input was ready on the compute stream, end when the collective had finished on the GPU,
both on the host's clock; such events carry clock="cuda".
A group spanning several replicas crosses the slow outer link; for a world-wide ring in rank
order, rank r's bytes go to rank r+1, so they cross the outer link exactly when r+1 lies in
another replica, and are recorded as `outer`, else `inner`.
What each collective puts on the wire, and which exchange `Comm.average` takes: wire.py; the
averages it starts (`Average`, `Weighted`, `TwoPhase`): exchanges.py.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lowband.comm.exchanges import Average, TwoPhase, Weighted, encoded
from lowband.comm.link import Link
from lowband.comm.membership.fixed import FixedMembership
from lowband.comm.wire import exchange_plan, wire_bytes
from lowband.telemetry import EventWriter
from lowband.comm.topology import Topology


@dataclass
class Totals:
    wire_bytes: dict = field(default_factory=lambda: {"outer": 0, "inner": 0})
    payload_bytes: dict = field(default_factory=lambda: {"outer": 0, "inner": 0})
    peak_outer_payload: int = 0
    transfers: int = 0
    setup_wire_bytes: int = 0  # one-time set-up (a user model's initial weights), kept apart

    def state(self) -> dict:
        return {"wire_bytes": dict(self.wire_bytes), "payload_bytes": dict(self.payload_bytes),
                "peak_outer_payload": self.peak_outer_payload, "transfers": self.transfers,
                "setup_wire_bytes": self.setup_wire_bytes}

    def restore(self, state: dict) -> None:
        self.wire_bytes, self.payload_bytes = dict(state["wire_bytes"]), dict(state["payload_bytes"])
        self.peak_outer_payload, self.transfers = state["peak_outer_payload"], state["transfers"]
        self.setup_wire_bytes = state.get("setup_wire_bytes", 0)


class Transfer:
    """A collective in flight. `wait()` blocks until it is done and returns its result tensor."""

    def __init__(self, comm: "Comm", work, result, record: dict, not_before: float = 0.0,
                 clock: "GpuClock | None" = None):
        self.comm, self.work, self.result, self.record = comm, work, result, record
        self.not_before = not_before  # when an emulated link lets the bytes arrive
        self._done = threading.Event()
        if work is None:
            self._finish(None)
        elif clock is not None:  # times from CUDA events, read when the collective is done
            start = clock.mark()
            clock.watch(work, lambda end: self._finish(None, (clock.seconds(start),
                                                              clock.seconds(end))))
        else:
            try:
                future = work.get_future()
            except RuntimeError:  # gloo's reduce-scatter has no future: a watcher stands in
                threading.Thread(target=self._watch, daemon=True).start()
            else:
                future.then(self._finish)

    def _watch(self) -> None:
        self.work.wait()
        self._finish(None)

    def _finish(self, _future, gpu_times: tuple[float, float] | None = None) -> None:
        end = time.time()
        if gpu_times is not None:
            (self.record["start"], end), self.record["clock"] = gpu_times, "cuda"
        self.record["end"] = max(end, self.not_before)
        self.comm._record(self.record)
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set() and time.time() >= self.not_before

    def wait(self):
        t0 = time.perf_counter()
        result = self.landed()
        self.comm.wait_s += time.perf_counter() - t0
        return result

    def landed(self):
        """wait() without counting the seconds as the training thread's (another thread waits)."""
        if self.work is not None:
            self.work.wait()
        self._done.wait()
        time.sleep(max(self.not_before - time.time(), 0.0))
        return self.result


class GpuClock:
    """Host-clock times of work on one CUDA device, read from CUDA events: an anchor event is
    recorded at a known host time, and an event's time is the anchor's plus the GPU-measured
    interval between them. A watcher thread takes collectives in the order they started: its
    side stream waits for each (NCCL: a stream dependency; gloo: the host-side exchange, then
    the copy back), records an event there, and once that event is done calls back with it.
    Neither the compute stream nor the training thread waits for the watcher."""

    def __init__(self, device: torch.device):
        self.device = device
        self.side = torch.cuda.Stream(device)  # where completion events are recorded
        torch.cuda.synchronize(device)
        self.anchor = self._event(torch.cuda.current_stream(device))
        self.anchor.synchronize()
        self.t0 = time.time()
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._watch, daemon=True).start()

    @staticmethod
    def _event(stream) -> "torch.cuda.Event":
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def mark(self):
        """An event on the compute stream, done once the work queued so far is."""
        return self._event(torch.cuda.current_stream(self.device))

    def seconds(self, event) -> float:
        return self.t0 + self.anchor.elapsed_time(event) / 1e3

    def watch(self, work, callback) -> None:
        """callback(event) once the collective `work` is done, the event recorded just then."""
        self.queue.put((work, callback))

    def _watch(self) -> None:
        torch.cuda.set_device(self.device)
        while True:
            work, callback = self.queue.get()
            with torch.cuda.stream(self.side):
                work.wait()
                event = self._event(self.side)
            event.synchronize()
            callback(event)


class Comm:
    def __init__(self, topology: Topology, events: EventWriter | None, link: Link | None = None,
                 clock: GpuClock | None = None):
        """clock: times transfers by CUDA events; made at the first transfer of a CUDA tensor."""
        self.topo, self.events, self.link, self.clock = topology, events, link, clock
        self.totals = Totals()
        # who the replica groups are (comm/membership/): fixed, or torchft's when elastic
        self.membership = FixedMembership(topology)
        self.wait_s = 0.0  # seconds the training thread spent blocked on transfers
        self._lock = threading.Lock()
        self._second: dict[str, dist.ProcessGroup] = {}  # side groups, by "GROUP:NAME"
        self._phase_two: queue.SimpleQueue | None = None  # the thread that starts them

    def take_wait_s(self) -> float:
        w, self.wait_s = self.wait_s, 0.0
        return w

    def link_of(self, group: str) -> str:
        """Which link a transfer on `group` travels: outer (slow) or inner (fast)."""
        t, group = self.topo, group.split(":")[0]  # a side group ("outer:grace") travels its own
        if group == "world":
            nxt = (t.rank + 1) % t.world
            return "outer" if nxt // t.shards != t.replica else "inner"
        return group

    def _clock_for(self, tensor: torch.Tensor) -> GpuClock | None:
        if self.clock is None and tensor.is_cuda:
            self.clock = GpuClock(tensor.device)
        return self.clock

    def _start(self, op, group, payload, launch, result, tag, codec, tensor,
               root=None, setup=False) -> Transfer:
        pg = self.topo.group(group)
        n = dist.get_world_size(pg)
        is_root = root is not None and n > 1 and dist.get_rank(pg) == root
        return self.run(op, self.link_of(group), n, payload, lambda: launch(pg), result, tag,
                        codec, tensor, is_root, setup)

    def run(self, op, link, n, payload, launch, result, tag, codec, tensor, is_root=False,
            setup=False) -> Transfer:
        """Record and start one collective of `n` ranks over `link` (outer or inner): launch()
        starts it and returns its work. What every collective here goes through;
        comm/membership/elastic.py calls it with torchft's process group."""
        record = {"op": op, "group": link, "tag": tag, "codec": codec,
                  "payload_bytes": int(payload), "wire_bytes": wire_bytes(op, payload, n, is_root),
                  "start": time.time()}
        if setup:
            record["setup"] = True
        not_before = 0.0
        if self.link is not None and record["group"] == "outer" and record["wire_bytes"]:
            record["begin"], not_before = self.link.schedule(record["start"], record["wire_bytes"])
        if n == 1:
            return Transfer(self, None, result, record, not_before)
        return Transfer(self, launch(), result, record, not_before, self._clock_for(tensor))

    def _record(self, rec: dict) -> None:
        if rec.pop("setup", False):  # before training: its own event kind, out of the sync figures
            with self._lock:
                self.totals.setup_wire_bytes += rec["wire_bytes"]
            if self.events is not None and rec["wire_bytes"]:
                self.events.emit("setup", **rec)
            return
        with self._lock:
            t = self.totals
            t.wire_bytes[rec["group"]] += rec["wire_bytes"]
            t.payload_bytes[rec["group"]] += rec["payload_bytes"]
            t.transfers += 1
            if rec["group"] == "outer" and rec["wire_bytes"]:
                t.peak_outer_payload = max(t.peak_outer_payload, rec["payload_bytes"])
        if self.events is not None and rec["wire_bytes"]:
            self.events.emit("comm", **rec)

    def all_reduce(self, tensor: torch.Tensor, group: str = "world", tag: str = "",
                   codec: str = "fp32") -> Transfer:
        """Sum `tensor` in place over `group`."""
        nbytes = tensor.numel() * tensor.element_size()
        return self._start("all_reduce", group, nbytes,
                           lambda pg: dist.all_reduce(tensor, group=pg, async_op=True),
                           tensor, tag, codec, tensor)

    def all_gather(self, tensor: torch.Tensor, group: str = "world", tag: str = "",
                   codec: str = "fp32") -> Transfer:
        """Gather `tensor` from every rank of `group`; the result is a list in group-rank order."""
        n = dist.get_world_size(self.topo.group(group))
        out = [torch.empty_like(tensor) for _ in range(n)] if n > 1 else [tensor]
        nbytes = tensor.numel() * tensor.element_size()
        return self._start("all_gather", group, nbytes,
                           lambda pg: dist.all_gather(out, tensor, group=pg, async_op=True),
                           out, tag, codec, tensor)

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, group: str = "world",
                       tag: str = "", codec: str = "fp32") -> Transfer:
        """Sum `tensor` (n equal chunks) over `group`; this rank gets its chunk in `output`."""
        nbytes = tensor.numel() * tensor.element_size()

        def launch(pg):
            # reduce_scatter_single is torch >= 2.13's name (reduce_scatter_tensor warns there)
            rs = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
            return rs(output, tensor, group=pg, async_op=True)

        if dist.get_world_size(self.topo.group(group)) == 1:
            output.copy_(tensor)
        return self._start("reduce_scatter", group, nbytes, launch, output, tag, codec, tensor)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, group: str = "world",
                  tag: str = "", codec: str = "fp32", setup: bool = False) -> Transfer:
        """Copy group-rank `src`'s tensor to every rank of `group`. setup: a one-time transfer
        before training (recorded as a `setup` event and in Totals.setup_wire_bytes, not in
        the outer/inner totals, the peak payload or `comm` events)."""
        nbytes = tensor.numel() * tensor.element_size()
        return self._start("broadcast", group, nbytes,
                           lambda g: dist.broadcast(tensor, group_src=src, group=g, async_op=True),
                           tensor, tag, codec, tensor, root=src, setup=setup)

    def average(self, x: torch.Tensor, group: str, codec: str = "fp32", block: int = 64,
                tag: str = "", exchange: str = "auto",
                weight: float | None = None) -> "Average | TwoPhase | Weighted":
        """Start averaging the flat fp32 tensor `x` over `group`, sent in `codec`.

        fp32 is a plain all-reduce. Every other codec travels encoded (the bytes that travel are
        the packed codes and scales), in the exchange `exchange_plan` picks (`exchange`: auto,
        all-gather or two-phase; see wire.py's docstring): the all-gather has each rank
        decode and sum every rank's payload in fp32, its own included; the two-phase exchange
        has each rank own a chunk, sum it and send back its re-encoded mean. Either way every
        rank ends with the same average. A non-finite `x` cannot be encoded; it is sent as a
        payload that decodes to NaN, so that every rank sees the same non-finite average and
        can skip the update alike.

        weight: this rank's weight (--merge-weights tokens); the result is then the weighted
        mean sum_i w_i x_i / sum_i w_i (see Weighted).
        """
        if group == "outer":  # the replica groups: the membership's (comm/membership/)
            return self.membership.average(self, x, codec, block, tag, exchange=exchange,
                                           weight=weight)
        return self.group_average(x, group, codec, block, tag, exchange, weight)

    def group_average(self, x: torch.Tensor, group: str, codec: str = "fp32", block: int = 64,
                      tag: str = "", exchange: str = "auto",
                      weight: float | None = None) -> "Average | TwoPhase | Weighted":
        """`average` over the topology's process group `group` itself: every exchange but
        torchft's (a fixed membership averages the outer group here)."""
        if weight is not None:
            total = self.all_reduce(x.new_tensor([float(weight)]), group, f"{tag}-weight")
            scaled = self.group_average(x * weight, group, codec, block, tag, exchange)
            sent = scaled.sent / weight if weight else torch.zeros_like(scaled.sent)
            return Weighted(scaled, sent, total, dist.get_world_size(self.topo.group(group)),
                            weight)
        n = dist.get_world_size(self.topo.group(group))
        how, _ = exchange_plan(codec, x.numel(), n, block, exchange)
        if how == "all-reduce":
            return Average(self.all_reduce(x.clone(), group, tag, codec), n, None, x)
        if how == "two-phase":
            return TwoPhase(self, x, group, codec, block, tag)
        payload, sent = encoded(x, codec, block)
        return Average(self.all_gather(payload, group, tag, codec), n, (x.numel(), codec, block), sent)

    def second_group(self, group: str) -> dist.ProcessGroup:
        """This rank's group of a second set of `group`'s groups, for the two-phase exchange's
        all-gathers, which its own thread starts (side_group)."""
        return self.side_group(group, "second")

    def side_group(self, group: str, name: str) -> dist.ProcessGroup:
        """This rank's group of another set of `group`'s groups, for collectives that one thread
        of their own starts (the two-phase exchange's all-gathers; --grace's stand-in,
        algorithms/grace.py): a group whose collectives all come from one thread gets them in
        the same order on every rank (the training thread's collectives, Comm's or not, stay
        on `group`). Made once, by every rank of the world alike (dist.new_group's contract):
        streaming starts a fragment's exchange on every rank at the same step, and the
        stand-in is made at set-up. Known to the topology as "GROUP:NAME"."""
        key = f"{group}:{name}"
        if key not in self._second:
            mesh = self.topo.mesh.mesh  # R x S global ranks: a column is an outer group
            layout = {"outer": mesh.T, "inner": mesh, "world": mesh.reshape(1, -1)}[group]
            self._second[key], _ = dist.new_subgroups_by_enumeration(layout.tolist())
            self.topo.side[key] = self._second[key]
        return self._second[key]

    def phase_two(self, exchange: "TwoPhase") -> None:
        """Hand a two-phase exchange to the thread that finishes them, in the order started."""
        if self._phase_two is None:
            self._phase_two = queue.SimpleQueue()
            threading.Thread(target=self._finish_exchanges, daemon=True).start()
        self._phase_two.put(exchange)

    def _finish_exchanges(self) -> None:
        while True:
            self._phase_two.get().finish()


