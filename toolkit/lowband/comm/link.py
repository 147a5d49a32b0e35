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

import threading
from dataclasses import dataclass

from lowband.options import ConfigError, Options, flag, option
from lowband.units import missing_unit, parse_bandwidth, parse_duration


@dataclass
class LinkOptions(Options):
    title = "emulated outer link (every algorithm)"
    link_bandwidth: str = option("100Mbit", "emulate the outer link's bandwidth, with its unit: "
                                 "100Mbit, 1Gbit, 500kbit; none: no emulated link (nor its "
                                 "latency)")
    link_latency: str = option("10ms", "emulated outer link latency, with its unit: 20ms, 150us, "
                               "1s (0: none)")

    @classmethod
    def resolve(cls, cfg, algorithm) -> None:
        """No emulated link (--link-bandwidth none, or empty) is recorded as "" with no latency."""
        if str(cfg.link_bandwidth).strip().lower() in NONE:
            cfg.link_bandwidth, cfg.link_latency = "", "0ms"

    @classmethod
    def check(cls, cfg) -> None:
        """Each value readable, and written with its unit when it is text (units.missing_unit:
        --link-latency 10 would be 10 s, --link-bandwidth 1000 1000 bit/s); a number given as a
        number (Python's 1e8: bit/s) is taken as it is."""
        for name, kind in (("link_bandwidth", "bandwidth"), ("link_latency", "latency")):
            why = missing_unit(getattr(cfg, name), kind)
            if why:
                raise ConfigError(f"{flag(name)} {str(getattr(cfg, name)).strip()} {why}")
        try:
            bits = parse_bandwidth(cfg.link_bandwidth or 0)
        except ValueError as e:
            raise ConfigError(f"--link-bandwidth: {e}, or none for no emulated link.") from None
        try:
            parse_duration(cfg.link_latency)
        except ValueError as e:
            raise ConfigError(f"--link-latency: {e}.") from None
        if cfg.link_bandwidth and not bits > 0:
            raise ConfigError(f"--link-bandwidth must be positive, got {cfg.link_bandwidth!r}: "
                              "give none for no emulated link.")

    @classmethod
    def build(cls, cfg) -> "Link | None":
        """The emulated link of a run, or None when it has none."""
        if not cfg.link_bandwidth:
            return None
        return Link(parse_bandwidth(cfg.link_bandwidth), parse_duration(cfg.link_latency))


NONE = ("", "none")  # --link-bandwidth values that mean no emulated link


def with_units(values: dict) -> dict:
    """A run's saved options (its config.json) with a bare-number link_bandwidth or link_latency
    (text, or a number a Python caller gave) written in the units it ran with (bit/s, seconds):
    runs saved before LinkOptions.check refused them are resumed and repeated as they ran."""
    values = dict(values)
    for name, kind, unit in (("link_bandwidth", "bandwidth", "bit"),
                             ("link_latency", "latency", "s")):
        value = values.get(name)
        if missing_unit(value, kind) or type(value) in (int, float):
            values[name] = f"{str(value).strip()}{unit}"
    return values


class Link:
    def __init__(self, bandwidth_bps: float, latency_s: float = 0.0):
        self.bandwidth, self.latency = bandwidth_bps, latency_s
        self._free_at = 0.0
        self._lock = threading.Lock()

    def schedule(self, start: float, wire_bytes: int) -> tuple[float, float]:
        """Put a transfer on the link; returns (when it begins to transmit, when it arrives)."""
        with self._lock:
            begin = max(start, self._free_at)
            self._free_at = begin + 8 * wire_bytes / self.bandwidth
            return begin, self._free_at + self.latency
