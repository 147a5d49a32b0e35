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

A measured link: `lowband doctor --save-link FILE` measures the real link between a job's
machines and saves it here as a `lowband-link` file (write_measured; read_measured checks one).
`--link FILE` emulates it: its slowest direction's bandwidth and its latency become the run's
--link-bandwidth and --link-latency, and the run keeps the record (config.json's meta.link).
"""

from __future__ import annotations

import datetime
import json
import math
import threading
from dataclasses import dataclass
from pathlib import Path

from lowband.options import ConfigError, Options, flag, option
from lowband.telemetry import write_json_atomic
from lowband.units import fmt_si, missing_unit, parse_bandwidth, parse_duration


@dataclass
class LinkOptions(Options):
    title = "emulated outer link (every algorithm)"
    link_bandwidth: str = option("100Mbit", "emulate the outer link's bandwidth, with its unit: "
                                 "100Mbit, 1Gbit, 500kbit; none: no emulated link (nor its "
                                 "latency)")
    link_latency: str = option("10ms", "emulated outer link latency, with its unit: 20ms, 150us, "
                               "1s (0: none)")
    link: str = option("", "a link measured by `lowband doctor --save-link FILE`: emulate it (its "
                       "slowest direction's bandwidth and its latency); it takes the place of "
                       "--link-bandwidth and --link-latency, given or not (docs/plan.md)")

    # the record of cfg.link's file, with "file": cfg.link, once resolved (config.json's
    # meta.link); a run read back from its config.json brings its own (recorded): not an option
    measured_link = None

    @classmethod
    def resolve(cls, cfg, algorithm) -> None:
        """--link FILE sets --link-bandwidth and --link-latency to the file's (the record a run
        read back from its config.json brought stands for the same file: it may be gone, or
        measured again since). No emulated link (--link-bandwidth none, or empty) is recorded
        as "" with no latency."""
        if not cfg.link:
            cfg.measured_link = None
        else:
            held = cfg.measured_link
            if not held or held.get("file") != cfg.link:
                held = {**read_measured(cfg.link), "file": cfg.link}
            cfg.measured_link = held
            cfg.link_bandwidth, cfg.link_latency = emulated(held)
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


def recorded(cfg, meta: dict | None):
    """cfg, a run's options read back from its config.json, with the measured link the run
    recorded (meta.link): resuming, repeating or planning the run takes the bandwidth and
    latency it ran with, without reading its --link file again."""
    cfg.measured_link = meta.get("link") if isinstance(meta, dict) else None
    return cfg


MEASURED_KIND = "lowband-link"  # the "kind" of a file `lowband doctor --save-link` writes
SAVED = "give a file `lowband doctor --save-link FILE` saved"  # the fix of a bad --link file


def write_measured(path, record: dict) -> Path:
    """Save a measured link (the record `lowband doctor` made: kind, version, bandwidth_bps,
    latency_s, and what else it measured) whole or not at all, checked as read_measured checks
    it, so a file it writes is one --link reads."""
    path = Path(path)
    _checked(record, f"the link to save in {path}", "fix what measured it")
    write_json_atomic(path, record)
    return path


def read_measured(path) -> dict:
    """The record of a measured link file; ConfigError, one sentence, where it is no such file.
    Only kind, bandwidth_bps and latency_s are needed; the rest is shown where present."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"--link {path} does not exist: {SAVED}.") from None
    except (IsADirectoryError, UnicodeDecodeError, PermissionError) as e:
        raise ConfigError(f"--link {path} cannot be read ({type(e).__name__}): {SAVED}.") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--link {path} is not JSON ({e}): {SAVED}.") from None
    return _checked(record, f"--link {path}", SAVED)


def _checked(record, named: str, fix: str) -> dict:
    """record, where it is a measured link a run can emulate; else ConfigError, one sentence:
    what `named` is not, and the fix."""
    if not isinstance(record, dict) or record.get("kind") != MEASURED_KIND:
        kind = record.get("kind") if isinstance(record, dict) else None
        said = "it has no kind" if kind is None else f"its kind is {kind!r}"
        raise ConfigError(f"{named} is not a measured link ({said}, not {MEASURED_KIND!r}): "
                          f"{fix}.")
    for key, positive, what in (("bandwidth_bps", True, "a positive number of bits per second"),
                                ("latency_s", False, "zero or a positive number of seconds")):
        value = record.get(key)
        if (not isinstance(value, (int, float)) or isinstance(value, bool)
                or not math.isfinite(value) or value < 0 or (positive and value == 0)):
            raise ConfigError(f"{named}: its {key} must be {what}, got {value!r}: {fix}.")
    return record


def emulated(record: dict) -> tuple[str, str]:
    """(--link-bandwidth, --link-latency) of a measured link, with units, that parse_bandwidth
    and parse_duration read back exactly: ("19600000bit", "0.00061s")."""
    return f"{_exact(record['bandwidth_bps'])}bit", f"{_exact(record['latency_s'])}s"


def _exact(x) -> str:
    text = repr(float(x))  # the shortest text of this float
    return text[:-2] if text.endswith(".0") else text


def describe_measured(record: dict) -> str:
    """One line: "measured by lowband doctor 2026-11-29 22:50 UTC between h0 and h1 over gloo
    over TCP: 19.6 Mbit/s h0->h1, 19.8 Mbit/s h1->h0, latency 0.61 ms; 4 streams 0.99x one's"
    (what the record holds of it)."""
    when = _when(record.get("measured_at"))
    names = [str(n.get("name")) for n in record.get("nodes") or () if isinstance(n, dict)]
    head = " ".join(["measured by", str(record.get("by") or "lowband doctor"), *when,
                     *(["between", _and(names)] if names else []),
                     *([f"over {record['transport']}"] if record.get("transport") else [])])
    pairs = [f"{_bits(p.get('bandwidth_bps'))} {p.get('from')}->{p.get('to')}"
             for p in record.get("pairs") or () if isinstance(p, dict)]
    line = f"{head}: " + (f"{', '.join(pairs)}, latency {_ms(record['latency_s'])}" if pairs
                          else link_words(record["bandwidth_bps"], record["latency_s"]))
    streams = record.get("streams")
    if isinstance(streams, dict) and isinstance(streams.get("ratio"), (int, float)):
        line += f"; {streams.get('count')} streams {streams['ratio']:.2f}x one's"
    return line


def link_words(bandwidth, latency) -> str:
    """"19.6 Mbit/s, latency 0.61 ms": a link's bandwidth (bit/s, or --link-bandwidth's text)
    and latency (seconds, or --link-latency's text)."""
    return f"{_bits(parse_bandwidth(bandwidth))}, latency {_ms(parse_duration(latency))}"


def _when(text) -> list[str]:
    """["2026-11-29 22:50 UTC"] of an ISO time ("2026-11-29T22:50:01Z"), as given where it
    reads otherwise, [] where there is none."""
    if not text:
        return []
    try:
        t = datetime.datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        return [str(text)]
    if t.utcoffset() == datetime.timedelta(0):
        return [t.strftime("%Y-%m-%d %H:%M UTC")]
    return [t.strftime("%Y-%m-%d %H:%M %z") if t.tzinfo else t.strftime("%Y-%m-%d %H:%M")]


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _bits(bps) -> str:
    return fmt_si(bps, "bit/s") if isinstance(bps, (int, float)) else "?"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


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
