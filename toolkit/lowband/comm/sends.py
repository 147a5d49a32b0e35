"""What an algorithm sends over the outer link, as the planner (plan/) replays it.

Each algorithm class declares its outer-link phases (`Algorithm.outer_link(run)`, in its own
file under algorithms/): a `Schedule` of `Send`s, read off the run's shape (`Run`: the model's
sizes, the replicas, H, P, tau, the codec, the step time). The planner's timeline (plan/timeline.py)
replays a schedule on one link; docs/plan.md states the model.

Time advances in *units* of compute of equal length: a step, or a share of one (acco: a round's;
edit: a block's forward or a third of a block's backward). A unit may release transfers at an
offset inside it, or when another transfer it released has arrived; a transfer names the unit
that cannot start before it arrives (its gate, counted in units after the sending one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from lowband.comm import codecs, wire
from lowband.comm.codecs import SPARSE, Chunks

GRAD_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0}  # what ddp, zero1 and acco may send


@dataclass(frozen=True)
class Run:
    """The validated shape of one planned run (everything but the algorithm), built only by
    plan.make_run, whose options not given are lowband train's (a Config's): no defaults here."""
    params: float
    layers: int
    step_time: float
    replicas: int
    sync_every: int
    fragments: int
    overlap: int
    codec: str
    grad_dtype: str               # what ddp, zero1 and acco send (lowband sends fp32)
    bandwidth: float | None
    latency: float
    steps: int | None             # the whole run of this many steps; None: the steady state
    block_size: int
    density: float                # topk codecs: the share of each chunk's values sent
    sparse_chunk: int             # topk codecs: values a chunk
    exchange: str                 # how a quantized average travels (wire.EXCHANGES)
    bucket_mb: float | None       # None: a bucket a block
    acco_rounds: int
    fragment_pattern: str
    fragment_sizes: tuple[int, ...]  # values in each of the P fragments
    shards: int                   # S: ranks of a replica group (the fast inner link)
    unit_sizes: tuple[int, ...]   # edit's units: the root's values, then each block's
    sync_seconds: float           # aedit: seconds of training between two syncs
    acco_adaptive: bool           # acco's adaptive micro-batches: a count all-gather a round
    slowdowns: tuple[float, ...]  # each replica's compute a step over step_time (--straggler)
    local_steps: str              # diloco, streaming: fixed, adaptive or each replica's speed

    @property
    def world(self) -> int:
        return self.replicas * self.shards


class Send(NamedTuple):
    offset: float          # released this many seconds into its unit...
    nbytes: float          # wire bytes this rank sends over the outer link
    gate: int              # the unit this many units later waits for its arrival
    after: int = -1        # ...or, if >= 0, when send `after` of the same unit has arrived


@dataclass(frozen=True)
class Schedule:
    """What one algorithm sends, and what waits for it."""
    unit_s: float                     # compute time of one unit
    units_per_step: int
    period: int                       # the send pattern repeats every `period` units
    offsets: tuple[int, ...]          # units (mod period) that send, in increasing order
    sends: tuple[tuple[Send, ...], ...]  # what the unit at each offset sends, in this order
    first: int = 0                    # no unit before this one sends (the first sync's)

    def every(self):
        return (send for sends in self.sends for send in sends)

    def quiet(self) -> "Schedule":
        """The same compute with nothing on the link (one replica)."""
        return Schedule(self.unit_s, self.units_per_step, self.period, (), ())


def block(run: Run) -> int | Chunks:
    """What the run's codec takes as its block, as the algorithms pass it: the block size, or
    for a topk codec its chunk and density."""
    return Chunks(run.sparse_chunk, run.density) if run.codec in SPARSE else run.block_size


def payload_bytes(run: Run, values: int) -> int:
    """The exact bytes `values` values take in the run's codec (lowband.comm.codecs)."""
    return codecs.payload_bytes(run.codec, values, block(run))


def exchange_phases(run: Run, values: int) -> tuple[int, ...]:
    """Wire bytes each rank sends in each collective of one average of `values` values over the
    run's R replicas, as Comm.average sends it: fp32 one all-reduce; another codec one
    all-gather of the encoded payloads, or two phases (an all-to-all of encoded chunks, then,
    once it has arrived, an all-gather of the owners' re-encoded means: half the bytes each).
    wire.exchange_plan picks the exchange, exchange_wire_bytes counts it."""
    if run.replicas == 1:
        return ()
    how, _ = wire.exchange_plan(run.codec, values, run.replicas, block(run), run.exchange)
    total = wire.exchange_wire_bytes(run.codec, payload_bytes(run, values), run.replicas,
                                     run.exchange, block(run))
    return (total // 2, total - total // 2) if how == "two-phase" else (total,)


def average(run: Run, values: int, gate: int, offset: float, after: int = -1,
            at: int = 0) -> tuple[Send, ...]:
    """The sends of one average of `values` values in the run's codec, released at `offset` into
    the unit (or when send `after` has arrived); each phase of the exchange pays its own
    latency, the next released once it has arrived. `at`: the index of its first send in the
    unit's list."""
    return tuple(Send(offset, w, gate, after) if i == 0 else Send(0.0, w, gate, at + i - 1)
                 for i, w in enumerate(exchange_phases(run, values)))


def chained(sends, gate: int, offset: float) -> tuple[Send, ...]:
    """Collectives one after another (each released when the one before it has arrived), the
    first at `offset`, all waited for by the unit `gate` units later; sends: wire bytes each."""
    return tuple(Send(offset, nbytes, gate, i - 1) for i, nbytes in enumerate(sends))
