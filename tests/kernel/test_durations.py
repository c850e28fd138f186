"""One rule for a duration anywhere in the API: a bare number is seconds (issue 29).

``DedupConfig.of(horizon=3600)`` used to be a 3.6-second horizon (a bare number was ms there
and in ``EventTime.of``, but seconds in windows and ``ttl``).
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from onceflow import DedupConfig, EventTime, Pipeline
from onceflow.kernel.durations import HOUR_MS, parse_duration_ms
from onceflow.kernel.errors import ConfigError
from onceflow.kernel.windows import Fixed, Sessions, Sliding, Trigger, windowing
from onceflow.pipeline.sinks import Collect
from onceflow.pipeline.sources import Collection
from onceflow.testing.teststream import TestStream

AN_HOUR = [3600, 3600.0, "3600", "1h", "60m", "3600s", "3600000ms", timedelta(hours=1)]


def test_a_bare_number_is_seconds_in_dedup_and_event_time_settings():
    assert DedupConfig.of(horizon=3600).horizon_ms == HOUR_MS
    assert DedupConfig.of(horizon="24h", bucket=3600).bucket_ms == HOUR_MS
    settings = EventTime.of(out_of_orderness=30, idle_timeout=60, max_ahead=3600)
    assert settings.out_of_orderness_ms == 30_000
    assert settings.idle_timeout_ms == 60_000
    assert settings.max_ahead_ms == HOUR_MS
    assert EventTime.of(max_clock_skew=60).max_clock_skew_ms == 60_000
    assert EventTime.of() == EventTime()  # the defaults did not move


def _ttl_ms(value: object) -> int:
    p = Pipeline("ttl")
    s = p.read("in", Collection([("k", 1)])).key_by("k", lambda kv: kv[0])
    s.combine_per_key("sum", "sum", ttl=value).write("out", Collect())
    return p.graph["sum"].ttl_ms


READERS = {
    "parse_duration_ms": parse_duration_ms,
    "DedupConfig.of horizon": lambda v: DedupConfig.of(horizon=v).horizon_ms,
    "DedupConfig.of bucket": lambda v: DedupConfig.of(horizon="1d", bucket=v).bucket_ms,
    "EventTime.of out_of_orderness": lambda v: EventTime.of(out_of_orderness=v).out_of_orderness_ms,
    "EventTime.of idle_timeout": lambda v: EventTime.of(idle_timeout=v).idle_timeout_ms,
    "EventTime.of max_ahead": lambda v: EventTime.of(max_ahead=v).max_ahead_ms,
    "EventTime.of max_clock_skew": lambda v: EventTime.of(max_clock_skew=v).max_clock_skew_ms,
    "Fixed": lambda v: Fixed(v).size_ms,
    "Sliding": lambda v: Sliding(v, v).every_ms,
    "Sessions": lambda v: Sessions(v).gap_ms,
    "allowed_lateness": lambda v: windowing(Fixed(1), allowed_lateness=v).allowed_lateness_ms,
    "Trigger early_seconds": lambda v: Trigger(early_seconds=v).early_ms,
    "ttl": _ttl_ms,
    "advance_processing_time": lambda v: TestStream().advance_processing_time(v).steps[-1].ms,
}


@pytest.mark.parametrize("read", READERS.values(), ids=READERS.keys())
@pytest.mark.parametrize("value", AN_HOUR, ids=repr)
def test_every_duration_reads_a_number_text_or_timedelta_alike(read, value):
    assert read(value) == HOUR_MS


@pytest.mark.parametrize("value", [True, None, "an hour", "-1h", float("nan"), [3600]])
def test_what_is_not_a_duration_says_how_to_write_one(value):
    with pytest.raises(ConfigError, match="number of seconds or a number and a unit"):
        parse_duration_ms(value, "horizon")
