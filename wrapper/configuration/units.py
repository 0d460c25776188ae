"""Durations as written in the config: `30s`, `2m`, `1h`, `250ms`, or a bare number of seconds."""

from __future__ import annotations

import math
import re

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(value: object) -> float:
    """Seconds from `30s`, `2m`, `1.5h`, `250ms` or a bare number of seconds."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r} (write e.g. 30s, 2m, 250ms)")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if not match and str(value).strip().startswith("-") and _DURATION.match(str(value).strip()[1:]):
            raise ValueError(f"a duration cannot be negative: {value!r}")
        if not match:
            raise ValueError(f"not a duration: {value!r} (write e.g. 30s, 2m, 250ms)")
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    if not math.isfinite(seconds):
        raise ValueError(f"not a duration: {value!r} (write e.g. 30s, 2m, 250ms)")
    if seconds < 0:
        raise ValueError(f"a duration cannot be negative: {value!r}")
    return seconds



_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "KIB": 1 << 10, "KI": 1 << 10, "M": 1000**2, "MB": 1000**2,
               "MIB": 1 << 20, "MI": 1 << 20, "G": 1000**3, "GB": 1000**3, "GIB": 1 << 30, "GI": 1 << 30,
               "T": 1000**4, "TB": 1000**4, "TIB": 1 << 40, "TI": 1 << 40}


def parse_size(value: object) -> int:
    """Bytes from `3GiB`, `512MiB`, `1.5GB`, `800M` or a bare number of bytes (GiB = 2^30, GB = 10^9)."""
    if isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError(f"not a size: {value!r} (write e.g. 3GiB, 512MiB, or a number of bytes)")
    if isinstance(value, int | float):
        size = float(value)
    else:
        match = _SIZE.match(str(value))
        if not match:
            raise ValueError(f"not a size: {value!r} (write e.g. 3GiB, 512MiB, or a number of bytes)")
        size = float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").upper()]
    if size <= 0:
        raise ValueError(f"a size must be more than 0: {value!r}")
    return int(size)


def format_size(nbytes: float) -> str:
    """`1.50 GiB`, `320.0 MiB`: how sizes are shown back."""
    if abs(nbytes) >= 1 << 30:
        return f"{nbytes / (1 << 30):.2f} GiB"
    return f"{nbytes / (1 << 20):.1f} MiB"
