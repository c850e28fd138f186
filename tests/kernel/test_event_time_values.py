"""What a user's timestamp function may return, and what it may not."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from onceflow.kernel.errors import ConfigError
from onceflow.kernel.eventtime import as_event_time


def test_milliseconds_and_aware_datetimes_are_event_times():
    assert as_event_time(1_700_000_000_123) == 1_700_000_000_123
    assert as_event_time(1.9) == 1
    assert as_event_time(datetime(1970, 1, 1, 0, 0, 1, 5000, tzinfo=UTC)) == 1005
    paris = timezone(timedelta(hours=1))
    assert as_event_time(datetime(1970, 1, 1, 1, 0, 0, tzinfo=paris)) == 0
    assert as_event_time(datetime(1969, 12, 31, 23, 59, 59, tzinfo=UTC)) == -1000


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (datetime(2026, 1, 1), "needs a timezone"),  # noqa: DTZ001 - the point of the test
        (True, "got bool"),
        ("1700000000000", "got str"),
        (float("nan"), "epoch milliseconds"),
        (2**70, "64-bit"),
    ],
)
def test_anything_else_is_refused_with_the_reason(value, reason):
    with pytest.raises(ConfigError, match=reason):
        as_event_time(value)
