"""Event time and the watermark: how far a pipeline's event time has surely got.

Each source partition (a *lane*: a Kafka topic-partition) reports the largest event time it
committed. The pipeline's watermark is the smallest of those over the lanes that are not idle,
minus the allowed out-of-orderness: records older than it are late. A lane is idle when the
other lanes have been delivering records for ``idle_timeout`` of processing time while it
delivered none: idleness is measured against the newest activity of any lane, not against the
wall clock, so downtime (a stopped or crashed pipeline) makes no lane idle, and a lane with a
backlog is read in every batch (the source shares each batch among every lane with records).
The watermark never moves back.

One record with a wrong clock (days ahead, or seconds taken for milliseconds) must not drag
the watermark with it: an event more than ``max_ahead`` ahead of the micro-batch's time is
not admitted (it becomes a dead letter with the reason), so no lane's maximum goes past the
clock plus that much.

The dedup horizon and GC are measured from this watermark (MillWheel's rule), and windows
close when it passes their end.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from onceflow.kernel.durations import HOUR_MS, MINUTE_MS, Duration, parse_duration_ms
from onceflow.kernel.errors import ConfigError

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MIN_MS, _MAX_MS = -(1 << 63), (1 << 63) - 1  # signed 64-bit milliseconds
DEFAULT_IDLE_MS = MINUTE_MS
DEFAULT_MAX_AHEAD_MS = HOUR_MS
DEFAULT_MAX_CLOCK_SKEW_MS = MINUTE_MS


@dataclass(frozen=True)
class EventTime:
    """Watermark settings of a pipeline (see the module docstring).

    ``out_of_orderness``: how far behind the newest event of a lane a record may still arrive
    on time. ``idle_timeout``: processing time after which a lane with no new records stops
    holding the watermark back. ``max_ahead``: how far ahead of the clock an event may be.
    ``max_clock_skew``: how far Redis's clock and the driver machine's may disagree before a
    micro-batch refuses to start (see :mod:`onceflow.dedup.clock`). The fields are ms;
    :meth:`of` takes durations as users write them (seconds, ``"5s"``, ``"10m"``, a timedelta).
    """

    out_of_orderness_ms: int = 0
    idle_timeout_ms: int = DEFAULT_IDLE_MS
    max_ahead_ms: int = DEFAULT_MAX_AHEAD_MS
    max_clock_skew_ms: int = DEFAULT_MAX_CLOCK_SKEW_MS

    def __post_init__(self) -> None:
        for name in ("out_of_orderness_ms", "idle_timeout_ms", "max_ahead_ms", "max_clock_skew_ms"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                msg = f"EventTime {name} must be a duration >= 0, got {value!r}"
                raise ConfigError(msg)

    @classmethod
    def of(
        cls,
        out_of_orderness: Duration = 0,
        idle_timeout: Duration = timedelta(milliseconds=DEFAULT_IDLE_MS),
        max_ahead: Duration = timedelta(milliseconds=DEFAULT_MAX_AHEAD_MS),
        max_clock_skew: Duration = timedelta(milliseconds=DEFAULT_MAX_CLOCK_SKEW_MS),
    ) -> EventTime:
        """Settings from durations: ``EventTime.of(out_of_orderness="5s", max_ahead="1h")``.

        A bare number is seconds (``max_ahead=3600`` is an hour), as everywhere in the API.
        """
        return cls(
            parse_duration_ms(out_of_orderness, "out_of_orderness"),
            parse_duration_ms(idle_timeout, "idle_timeout"),
            parse_duration_ms(max_ahead, "max_ahead"),
            parse_duration_ms(max_clock_skew, "max_clock_skew"),
        )

    def limit(self, batch_time_ms: int) -> int:
        """The newest event time admitted in a micro-batch that started at ``batch_time_ms``."""
        return batch_time_ms + self.max_ahead_ms


def watermark(
    lanes: Mapping[str, tuple[int, int]],
    batch_time_ms: int,
    previous: int,
    settings: EventTime,
) -> int:
    """The pipeline watermark from each lane's ``(largest event time, last active time)``.

    The minimum over lanes active within ``idle_timeout`` of the newest activity of any lane,
    minus the out-of-orderness; never below ``previous`` and never past the batch's own time.
    """
    if not lanes:
        return previous
    latest = max(seen for _, seen in lanes.values())
    active = [
        newest for newest, seen in lanes.values() if latest - seen <= settings.idle_timeout_ms
    ]
    candidate = min(active) - settings.out_of_orderness_ms
    return max(previous, min(candidate, batch_time_ms))


def as_event_times(values: list[Any]) -> list[int]:
    """:func:`as_event_time` of every value (ints in range, the common case: checked at once)."""
    if (
        values
        and set(map(type, values)) == {int}
        and _MIN_MS <= min(values)
        and max(values) <= _MAX_MS
    ):
        return values
    return list(map(as_event_time, values))


def as_event_time(value: Any) -> int:
    """An event time as a user function gives it, in epoch milliseconds.

    Milliseconds as an int (or a float, rounded down), or a timezone-aware ``datetime``; a
    naive ``datetime`` is refused (its zone is a guess), as are booleans and times outside
    64-bit milliseconds.
    """
    if type(value) is int and _MIN_MS <= value <= _MAX_MS:  # the common case, fast (per record)
        return value
    if isinstance(value, datetime):
        if value.tzinfo is None:
            msg = "an event time datetime needs a timezone (for example tzinfo=timezone.utc)"
            raise ConfigError(msg)
        ms = (value - _EPOCH) // timedelta(milliseconds=1)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        if value != value or value in (float("inf"), float("-inf")):  # noqa: PLR0124 - NaN
            msg = f"an event time must be epoch milliseconds, got {value!r}"
            raise ConfigError(msg)
        ms = int(value)
    else:
        msg = (
            f"an event time must be epoch milliseconds (int) or an aware datetime, got "
            f"{type(value).__name__}"
        )
        raise ConfigError(msg)
    if not _MIN_MS <= ms <= _MAX_MS:
        msg = f"event time {ms} does not fit 64-bit milliseconds"
        raise ConfigError(msg)
    return ms
