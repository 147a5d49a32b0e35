"""Reading and writing quantities: bandwidths in bits per second, durations, SI-prefixed sizes.

One parser for every place a user writes a bandwidth (--link-bandwidth, lowband plan) and every
place that reads one back (dashboard, report).
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


def fmt_si(x, unit: str = "", digits: int = 3) -> str:
    """1234567 -> '1.23 MB' (with unit 'B'); None or non-finite -> '–'."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    x = float(x)
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.{digits}g} {prefix}{unit}"
    return f"{x:.{digits}g} {unit}".rstrip()
