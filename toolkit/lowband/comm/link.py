"""An emulated slow link on the outer group: bandwidth, latency, and one FIFO queue.

Each rank's outgoing outer bytes share one link. A transfer that starts at t0 begins
transmitting when the link is free, occupies it for wire_bits / bandwidth, and arrives one
latency later:
    begin  = max(t0, link free)
    free   = begin + bits / bandwidth
    arrive = free + latency
The transfer completes no earlier than `arrive` (and no earlier than the real collective), so
back-to-back transfers queue as on a real connection. The peers of a collective send the same
amount at the same time, so this rank's own link stands for the whole exchange.
"""

from __future__ import annotations

import re
import threading

_BITS = {"": 1, "bit": 1, "b": 1, "kbit": 1e3, "kb": 1e3, "mbit": 1e6, "mb": 1e6, "gbit": 1e9,
         "gb": 1e9, "tbit": 1e12, "tb": 1e12}
_SECONDS = {"": 1, "s": 1, "ms": 1e-3, "us": 1e-6}


def _parse(text: str, units: dict, what: str, example: str) -> float:
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)(?:/s|ps)?\s*", str(text).lower())
    if not m or m.group(2) not in units:
        raise ValueError(f"cannot read {what} '{text}': write it like {example}")
    return float(m.group(1)) * units[m.group(2)]


def parse_bandwidth(text: str | float) -> float:
    """Bits per second from '100Mbit', '1gbit', '2.5e9' (bits), 0 for none."""
    return _parse(text, _BITS, "the bandwidth", "100Mbit, 1Gbit or 1e9")


def parse_duration(text: str | float) -> float:
    """Seconds from '20ms', '0.02', '150us'."""
    return _parse(text, _SECONDS, "the latency", "20ms, 150us or 0.02")


class Link:
    def __init__(self, bandwidth_bps: float, latency_s: float = 0.0):
        self.bandwidth, self.latency = bandwidth_bps, latency_s
        self._free_at = 0.0
        self._lock = threading.Lock()

    def schedule(self, start: float, wire_bytes: int) -> float:
        """Put a transfer on the link; returns the time it arrives."""
        with self._lock:
            begin = max(start, self._free_at)
            self._free_at = begin + 8 * wire_bytes / self.bandwidth
            return self._free_at + self.latency
