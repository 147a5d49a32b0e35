"""Outer-link bandwidth: transfers replayed on their links and binned over time.

OuterTraffic is a part of RunModel (it reads the model's outer transfers, times and config);
bin_transfers spreads each transfer's bytes evenly over its window into bins, exactly;
parse_bits and parse_seconds read the emulated link's config (docs/dashboard.md, "Outer-link
bandwidth").
"""

from __future__ import annotations

import math

import numpy as np

from lowband import units

from .records import _natural


BINS = 300  # the bins of the figure and of the summary's peak, so that both name one peak


class OuterTraffic:
    """RunModel's outer-link traffic (a mixin: reads outer, t0, t_last, config; calls _cached)."""

    def bandwidth(self, max_bins: int = BINS, by: str = "link") -> dict:
        """Outer-link traffic binned over time (seconds since t0).

        Each rank's outgoing outer bytes share one link (the comm layer's emulated link is per
        rank), and each comm event's wire_bytes are what that rank sent. by="link": one series
        per rank link, split by direction when comm events carry a `direction`; by="total": one
        series, the sum over links. Each transfer's bytes are spread evenly over its
        transmission window (see transmission_windows).

        Returns {"edges": bin edges (s), "width": s, "series": {name: bytes/s per bin},
        "links": links that carried bytes, "peak": highest binned rate of one series (by
        "link": the run's peak bandwidth, as the summary table and the figure give it),
        "mean": mean rate of the busiest link over the run, "capacity": bytes/s or None}.
        """
        return self._cached((max_bins, by), lambda: self._binned(max_bins, by))

    def _binned(self, max_bins: int, by: str) -> dict:
        out = {"edges": np.zeros(0), "width": 0.0, "series": {}, "links": 0, "peak": 0.0,
               "mean": 0.0, "capacity": self.capacity()}
        if self.outer and self.t0 is not None:
            self._bin_outer(out, max_bins, by)
        return out

    def _bin_outer(self, out: dict, max_bins: int, by: str) -> None:
        starts, ends = self.transmission_windows()
        starts, ends = starts - self.t0, ends - self.t0
        nbytes = np.fromiter((x.wire_bytes for x in self.outer), float, len(self.outer))
        t_end = max(float(ends.max()), (self.t_last or self.t0) - self.t0)
        t_start = min(0.0, float(starts.min()))
        width = nice_width((t_end - t_start) / max_bins)
        nbins = min(max(1, int(math.ceil((t_end - t_start) / width - 1e-9))), max_bins + 1)
        edges = t_start + width * np.arange(nbins + 1)
        if edges[-1] < t_end:   # float round-off: make sure the last transfer fits
            edges[-1] = t_end
        if by == "total":
            keys = ["all links"] * len(self.outer)
        else:
            keys = [f"rank {x.rank} {x.direction}" if x.direction else f"rank {x.rank}"
                    for x in self.outer]
        keys_arr = np.array(keys)
        series = {}
        for k in sorted(set(keys), key=_natural):
            m = keys_arr == k
            series[k] = bin_transfers(starts[m], ends[m], nbytes[m], edges) / np.diff(edges)
        per_link: dict[int, float] = {}
        for x in self.outer:
            per_link[x.rank] = per_link.get(x.rank, 0.0) + x.wire_bytes
        out.update(edges=edges, width=width, series=series, links=len(per_link),
                   peak=max(float(v.max()) for v in series.values()),
                   mean=max(per_link.values()) / max(t_end - t_start, 1e-9))

    def transmission_windows(self) -> tuple[np.ndarray, np.ndarray]:
        """When each outer transfer's bytes were on the wire (unix s), in self.outer's order.

        A comm event's [start, end] runs from the request to completion, so with an emulated
        link (config link_bandwidth) it includes waiting in the link's FIFO queue behind earlier
        transfers and the link latency. There, a rank's transfers are replayed in order of
        start: one begins when it starts or when the previous one left the link, whichever is
        later, and ends at `end` less the latency. An event's own `begin` field, when present,
        is used as is. Without an emulated link the windows are [start, end].
        """
        n = len(self.outer)
        starts = np.fromiter((x.start for x in self.outer), float, n)
        ends = np.fromiter((x.end for x in self.outer), float, n)
        if self.capacity() is None and not any(x.begin is not None for x in self.outer):
            return starts, ends
        latency = self.link_latency()
        free: dict[int, float] = {}
        for i in sorted(range(n), key=lambda i: (self.outer[i].start, self.outer[i].end)):
            x = self.outer[i]
            begin = x.begin if x.begin is not None else max(x.start, free.get(x.rank, x.start))
            begin = min(max(begin, x.start), x.end)
            done = x.end - latency if x.end - latency > begin else x.end
            starts[i], ends[i] = begin, done
            free[x.rank] = max(free.get(x.rank, done), done)
        return starts, ends

    def capacity(self) -> float | None:
        """The outer link's capacity in bytes/s, from config link_bandwidth (bits/s, either a
        number or text like "100Mbit"); None when the run has no emulated link."""
        bits = parse_bits(self.config.get("link_bandwidth"))
        return bits / 8.0 if bits else None

    def link_latency(self) -> float:
        return parse_seconds(self.config.get("link_latency")) or 0.0


def _optional(parse, value) -> float | None:
    """A positive finite quantity, or None when unset or unreadable (the trainer's config
    check is the one that refuses bad input)."""
    if value is None or value == "":
        return None
    try:
        v = parse(value)
    except ValueError:
        return None
    return v if 0 < v < math.inf else None


def parse_bits(value) -> float | None:
    """Bits per second from a config value: 1e8, "100Mbit", "1Gbit/s", "10mbps"."""
    return _optional(units.parse_bandwidth, value)


def parse_seconds(value) -> float | None:
    """Seconds from 0.02, "20ms", "150us"."""
    return _optional(units.parse_duration, value)


def nice_width(w: float) -> float:
    """The smallest 1-2-5 multiple of a power of ten that is at least w (and at least 1 ms)."""
    w = max(w, 1e-3)
    exp = math.floor(math.log10(w))
    for m in (1, 2, 5, 10):
        if m * 10 ** exp >= w * (1 - 1e-9):
            return m * 10 ** exp
    return 10 ** (exp + 1)


def bin_transfers(starts, ends, nbytes, edges) -> np.ndarray:
    """Bytes per bin when each transfer's bytes are spread evenly over [start, end].

    Exact and O((N + K) log N): the bytes carried up to time x are
    F(x) = sum_i r_i * (clip(x, s_i, e_i) - s_i), r_i = b_i / (e_i - s_i), evaluated at every
    edge with prefix sums over the sorted starts and ends. Zero-length transfers land whole in
    the bin holding their start. Bytes outside [edges[0], edges[-1]] are dropped.
    """
    starts, ends = np.asarray(starts, float), np.asarray(ends, float)
    nbytes, edges = np.asarray(nbytes, float), np.asarray(edges, float)
    out = np.zeros(max(len(edges) - 1, 0))
    if not len(starts) or not len(out):
        return out
    dur = ends - starts
    point = dur <= 0
    if point.any():
        idx = np.searchsorted(edges, starts[point], side="right") - 1
        ok = (idx >= 0) & (idx < len(out))
        ok |= starts[point] == edges[-1]
        idx = np.clip(idx, 0, len(out) - 1)
        np.add.at(out, idx[ok], nbytes[point][ok])
    span = ~point
    if span.any():
        s, e, b = starts[span], ends[span], nbytes[span]
        r = b / (e - s)

        def cum(x_sorted, rates):
            order = np.argsort(x_sorted)
            xs, rs = x_sorted[order], rates[order]
            return xs, np.concatenate([[0.0], np.cumsum(rs)]), \
                np.concatenate([[0.0], np.cumsum(rs * xs)])

        xs_s, r_s, rx_s = cum(s, r)
        xs_e, r_e, rx_e = cum(e, r)
        i_s = np.searchsorted(xs_s, edges, side="left")
        i_e = np.searchsorted(xs_e, edges, side="left")
        f = (edges * r_s[i_s] - rx_s[i_s]) - (edges * r_e[i_e] - rx_e[i_e])
        out += np.diff(f)
    return out
