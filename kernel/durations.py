"""Durations written the way people write them: ``24h``, ``10m``, ``30s``, ``500ms``, ``7d``.

One rule for every duration a user passes to the public API (dedup horizon, watermark
settings, windows, triggers, ``ttl``, test clocks) and to the command line: a bare number is
**seconds** (``3600``, ``"90"``), text may carry its unit, and a :class:`datetime.timedelta`
is taken as it is. Code that already holds milliseconds sets an ``*_ms`` field instead of
passing a number through here.
"""

from __future__ import annotations

import math
import re
from datetime import timedelta

from onceflow.kernel.errors import ConfigError

SECOND_MS = 1000
MINUTE_MS = 60 * SECOND_MS
HOUR_MS = 60 * MINUTE_MS
DAY_MS = 24 * HOUR_MS
_UNITS_MS = {"ms": 1, "s": SECOND_MS, "m": MINUTE_MS, "h": HOUR_MS, "d": DAY_MS}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")  # no unit: seconds
_ONE_MS = timedelta(milliseconds=1)

Duration = float | str | timedelta  # seconds, "24h" / "500ms", or a timedelta


def parse_duration_ms(value: Duration, what: str = "duration") -> int:
    """``value`` in ms: a number of seconds, ``"24h"``/``"10m"``/``"500ms"``, or a timedelta."""
    if isinstance(value, timedelta):
        return round(value / _ONE_MS)
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return round(value * SECOND_MS)
    match = _DURATION.match(value) if isinstance(value, str) else None
    if not match:
        msg = (
            f"{what} {value!r} is not valid: write a number of seconds or a number and a "
            "unit, e.g. 24h, 10m, 30s, 500ms"
        )
        raise ConfigError(msg)
    return int(float(match.group(1)) * _UNITS_MS[match.group(2) or "s"])
