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
        if not match:
            raise ValueError(f"not a duration: {value!r} (write e.g. 30s, 2m, 250ms)")
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    if not math.isfinite(seconds):
        raise ValueError(f"not a duration: {value!r} (write e.g. 30s, 2m, 250ms)")
    if seconds < 0:
        raise ValueError(f"a duration cannot be negative: {value!r}")
    return seconds

