"""Durations written the way people write them: ``24h``, ``10m``, ``30s``, ``500ms``, ``7d``."""

from __future__ import annotations

import re

from onceflow.kernel.errors import ConfigError

SECOND_MS = 1000
MINUTE_MS = 60 * SECOND_MS
HOUR_MS = 60 * MINUTE_MS
DAY_MS = 24 * HOUR_MS
_UNITS_MS = {"ms": 1, "s": SECOND_MS, "m": MINUTE_MS, "h": HOUR_MS, "d": DAY_MS}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")


def parse_duration_ms(text: str | int, what: str = "duration") -> int:
    """``"24h"``, ``"10m"``, ``"30s"``, ``"500ms"``, ``"7d"`` (or a number of ms) in ms."""
    if isinstance(text, bool):
        msg = f"{what} {text!r} is not valid: write a number and a unit, e.g. 24h, 10m, 30s"
        raise ConfigError(msg)
    if isinstance(text, int):
        return text
    if str(text).strip() == "0":
        return 0
    match = _DURATION.match(str(text))
    if not match:
        msg = f"{what} {text!r} is not valid: write a number and a unit, e.g. 24h, 10m, 30s"
        raise ConfigError(msg)
    return int(float(match.group(1)) * _UNITS_MS[match.group(2)])
