"""The wire arithmetic: the bytes a collective puts on the wire, and which exchange
`Comm.average` takes for a codec and what it sends. The planner (plan/) reads these; the
collectives (collectives.py) and exchanges (exchanges.py) record and move the bytes.

Wire bytes per rank, for a group of n ranks (ring algorithms, the bandwidth-optimal schedule):
  all_reduce       2 (n-1)/n x payload
  all_gather       (n-1) x payload              (payload = this rank's input)
  reduce_scatter   (n-1)/n x the input          (payload = the input)
  broadcast        (n-1) x payload on the root, 0 elsewhere
  all_to_all       (n-1)/n x the input           (payload = the input, n equal chunks)
`Comm.average` in a quantized codec takes one of two exchanges (`exchange_plan`):
  all-gather   every rank's encoded payload P to every rank, each rank decodes and sums the n of
               them: (n-1) x P a rank, one quantization.
  two-phase    the vector cut into n chunks of whole codec blocks (rank j owns chunk j, the last
               padded with zeros); an all-to-all of the encoded chunks, each owner decodes the n
               encodings of its chunk, sums them in fp32, divides by n and re-encodes the mean,
               then an all-gather of the encoded means: 2 (n-1) x C a rank, C = the payload of
               one chunk (about P/n), so 2 (n-1)/n x P plus the padding of at most n-1 blocks.
  auto takes the one that sends fewer bytes, a tie going to the all-gather: at n = 2 the two
  send the same (P vs 2 x P/2, plus padding) and the all-gather quantizes once, so it is kept;
  from n = 3 on the two-phase exchange wins on all but tiny vectors.
Which codecs may take the two-phase exchange their records say (codecs.Codec.two_phase): every
dense one unless it says why not (fp32: an all-reduce sums it; the topk codecs keep the
all-gather); the planner, the config's check and Comm.average all read that one fact.
"""

from __future__ import annotations

import math

from lowband.comm.codecs import CODEC_RECORDS, TWO_PHASE, payload_bytes


def wire_bytes(op: str, payload: int, n: int, is_root: bool = False) -> int:
    if n <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1) * payload // n
    if op == "all_gather":
        return (n - 1) * payload
    if op in ("reduce_scatter", "all_to_all"):  # this rank keeps 1/n of its input
        return (n - 1) * payload // n
    if op == "broadcast":
        return (n - 1) * payload if is_root else 0
    if op == "send":  # one peer's (algorithms/grace.py's arrivals)
        return payload
    raise ValueError(f"unknown collective {op}")


EXCHANGES = ("auto", "all-gather", "two-phase")  # how Comm.average moves a quantized codec


def chunk_values(numel: int, n: int, codec: str, block: int) -> int:
    """Values in each of the two-phase exchange's n chunks: numel / n rounded up to whole
    codec blocks, so that no block's scale straddles two chunks."""
    align = block if CODEC_RECORDS[codec].scaled else 1
    return math.ceil(numel / (n * align)) * align


def exchange_plan(codec: str, numel: int, n: int, block: int = 64,
                  mode: str = "auto") -> tuple[str, int]:
    """(the exchange Comm.average takes for numel values over n ranks: "all-reduce" (fp32),
    "all-gather" or "two-phase"; the bytes each rank sends for it)."""
    if mode not in EXCHANGES:
        raise ValueError(f"unknown exchange '{mode}': use one of {', '.join(EXCHANGES)}")
    if codec == "fp32":  # summed exactly on the way
        return "all-reduce", wire_bytes("all_reduce", 4 * numel, n)
    gather = wire_bytes("all_gather", payload_bytes(codec, numel, block), n)
    two_phase = CODEC_RECORDS[codec].two_phase  # the codec's record says (codecs.py)
    if mode == "two-phase" and not two_phase:
        raise ValueError(f"the two-phase exchange takes a dense codec ({', '.join(TWO_PHASE)}), "
                         f"not {codec}")
    if mode == "all-gather" or not two_phase or n == 1:
        return "all-gather", gather
    chunk = payload_bytes(codec, chunk_values(numel, n, codec, block), block)
    two = wire_bytes("all_to_all", n * chunk, n) + wire_bytes("all_gather", chunk, n)
    return ("two-phase", two) if mode == "two-phase" or two < gather else ("all-gather", gather)


def exchange_wire_bytes(codec: str, payload_bytes: float, n: int, mode: str = "auto",
                        block: int = 64) -> int:
    """Bytes each rank sends in one Comm.average over n ranks of a vector whose encoded payload
    (codecs.payload_bytes) is `payload_bytes`, the exchange chosen by `mode` as Comm.average
    chooses it. Exact for a payload size encode() makes; another size stands for the smallest
    vector whose payload is at least that big."""
    if codec == "fp32" or not CODEC_RECORDS[codec].two_phase:  # no need to know the values
        exchange_plan(codec, 0, n, block, mode)  # refuses a bad mode
        return wire_bytes("all_reduce" if codec == "fp32" else "all_gather", math.ceil(payload_bytes), n)
    return exchange_plan(codec, _numel(codec, payload_bytes, block), n, block, mode)[1]


def _numel(codec: str, nbytes: float, block: int) -> int:
    """The smallest number of values whose payload in a dense codec is at least nbytes."""
    lo, hi = 0, 2 * math.ceil(nbytes)  # a payload holds at least half a byte a value
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if payload_bytes(codec, mid, block) < nbytes else (lo, mid)
    return lo
