"""Reading and writing quantities: bandwidths in bits per second, durations, SI-prefixed sizes.

One parser for every place a user writes a bandwidth (--link-bandwidth, lowband plan) and every
place that reads one back (dashboard, report). The parsers take bare numbers (bit/s, seconds),
as saved configs and Python callers give them; text a user typed without its unit is refused
before it reaches them (missing_unit, comm/link.py).
"""

from __future__ import annotations

import math
import re

_NUM = r"\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*"
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_SECONDS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_bandwidth(value) -> float:
    """Bits per second from 1e9, '100Mbit', '1gbit', '10Gbps', '1Gb/s', '100mbit/s' or 'inf'.

    Byte units ('MB/s', '125MB') are refused rather than guessed."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        bits = float(value)
    elif str(value).strip().lower() in ("inf", "infinity"):
        bits = math.inf
    else:
        m = re.fullmatch(_NUM + r"([kKmMgGtT]?)(bits?|b|bps)?(/s)?\s*", str(value))
        if not m or "B" in (m.group(3) or ""):
            raise ValueError(f"cannot read the bandwidth '{value}': write bits per second like "
                             "100Mbit, 1Gbit or 1e9")
        bits = float(m.group(1)) * _PREFIX[m.group(2).lower()]
    if bits < 0 or math.isnan(bits):
        raise ValueError(f"the bandwidth must not be negative, got {value}")
    return bits


def parse_duration(value) -> float:
    """Seconds from 0.02, '20ms', '150us', '1s'."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        m = re.fullmatch(_NUM + r"(s|ms|us|µs|ns)?\s*", str(value))
        if not m:
            raise ValueError(f"cannot read the duration '{value}': write it like 20ms, 150us or 0.02")
        seconds = float(m.group(1)) * _SECONDS[m.group(2) or ""]
    if seconds < 0 or math.isnan(seconds):
        raise ValueError(f"the duration must not be negative, got {value}")
    return seconds


def missing_unit(value, kind: str) -> str | None:
    """Why a bandwidth or latency a user typed as a bare number ('1000', '10') is refused, with
    the value it most likely meant: '1000' -> '1000Mbit' (a bandwidth this small was not meant
    in bit/s), '2e9' -> '2Gbit' (100000 and above: bit/s written out); a latency '10' -> '10ms',
    '0.02' -> '20ms' (below 1: seconds). kind: 'bandwidth' or 'latency'. None when the value
    has a unit, is a number given as a number (Python's 1e9: bit/s; 0.01: seconds; a saved
    config's), is zero (the same in every unit), or is no number at all (the parser's to
    refuse). Read back, parse_bandwidth and parse_duration still take bare numbers."""
    if isinstance(value, (int, float)) or not re.fullmatch(_NUM, str(value)):
        return None
    x = float(value)
    if not (x > 0 and math.isfinite(x)):  # 0 in any unit; a negative: the parser's sentence
        return None
    if kind == "bandwidth" and x >= 1e5:  # bit/s written out
        factor, prefix = next((f, p) for f, p in ((1e9, "G"), (1e6, "M"), (1e3, "k")) if x >= f)
        meant = f"{x / factor:g}{prefix}bit"
    elif kind == "bandwidth":
        meant = f"{str(value).strip()}Mbit"
    else:
        meant = f"{x * 1e3:g}ms" if x < 1 else f"{str(value).strip()}ms"
    others = ("1Gbit", "100kbit", "100Mbit") if kind == "bandwidth" else ("1s", "150us", "20ms")
    shown = [meant, *(o for o in others if o != meant)][:3]
    return f"has no unit: did you mean {meant}? (write it with its unit: {', '.join(shown)})."


def fmt_si(x, unit: str = "", digits: int = 3) -> str:
    """1234567 -> '1.23 MB' (with unit 'B'); None or non-finite -> '–'."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    x = float(x)
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.{digits}g} {prefix}{unit}"
    return f"{x:.{digits}g} {unit}".rstrip()
