"""A micro-batch's parameters against a real Redis: the watermark from the source lanes, the
dedup-time clock, and parameters fixed by a batch's first attempt (item 9 of the reliability
issue: a horizon changed between runs must not reclassify a replayed batch)."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onceflow.dedup.batch import advance, fix_batch_params, read_batch_params
from onceflow.dedup.config import DedupConfig
from onceflow.dedup.errors import FencedError
from onceflow.kernel.eventtime import EventTime, watermark
from onceflow.kernel.keyspace import Keyspace

HOUR = 3_600_000
NOW = 1_795_000_000_000
pytestmark = pytest.mark.redis


def test_the_watermark_is_the_slowest_active_lane_minus_the_allowed_disorder():
    settings_ = EventTime.of(out_of_orderness="10s", idle_timeout="1m")
    lanes = {"t:0": (NOW - 5_000, NOW), "t:1": (NOW - 60_000, NOW - 1_000)}
    assert watermark(lanes, NOW, 0, settings_) == NOW - 60_000 - 10_000


def test_an_idle_lane_stops_holding_the_watermark_back():
    settings_ = EventTime.of(idle_timeout="1m")
    lanes = {"t:0": (NOW - 5_000, NOW), "t:1": (NOW - 3 * HOUR, NOW - 2 * 60_000)}
    assert watermark(lanes, NOW, 0, settings_) == NOW - 5_000


def test_downtime_makes_no_lane_idle():
    """After a restart every lane was silent for a while: none of them is idle for that."""
    settings_ = EventTime.of(idle_timeout="1m")
    before = {"t:0": (NOW - 10_000, NOW - HOUR), "t:1": (NOW - 900_000, NOW - HOUR - 5_000)}
    assert watermark(before, NOW, 0, settings_) == NOW - 900_000, "the slow lane still counts"


def test_the_watermark_never_moves_back_nor_past_the_clock():
    settings_ = EventTime()
    assert watermark({"t:0": (NOW - HOUR, NOW)}, NOW, NOW - 10, settings_) == NOW - 10
    assert watermark({"t:0": (NOW + HOUR, NOW)}, NOW, 0, settings_) == NOW


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10**7), st.integers(0, 10**7)), max_size=30))
def test_dedup_time_moves_no_faster_than_the_watermark_or_the_clock(steps):
    tau = wm = clock = 0
    for dw, dt in steps:
        new = advance(tau, wm, wm + dw, clock, clock + dt)
        assert new - tau == min(dw, dt)
        tau, wm, clock = new, wm + dw, clock + dt
    assert tau <= min(wm, clock)


def test_a_watermark_that_jumps_does_not_make_the_first_batch_forgotten():
    """The first batch runs before any event time is known; the next knows the real one."""
    assert advance(NOW, 0, NOW - 60_000, NOW, NOW + 2_000) == NOW + 2_000


def _namespace(client):
    ks = Keyspace(f"params-{uuid.uuid4().hex[:8]}")
    client.set(ks.epoch, 1)
    return ks


def test_a_replayed_batch_keeps_the_parameters_of_its_first_attempt(redis_server):
    client = redis_server.client()
    ks = _namespace(client)
    client.hset(ks.lanes, mapping={"t:0": NOW - 30 * HOUR})
    client.hset(ks.lane_activity, mapping={"t:0": NOW})
    first = fix_batch_params(client, ks, 1, 7, DedupConfig.of(horizon="24h"), EventTime())
    client.hset(ks.lanes, mapping={"t:0": NOW - HOUR})  # the batch committed some records
    again = fix_batch_params(client, ks, 1, 7, DedupConfig.of(horizon="2h"), EventTime())
    assert again == first, "a replay must admit and place records as the first attempt did"
    assert read_batch_params(client, ks, 7) == first
    nxt = fix_batch_params(client, ks, 1, 8, DedupConfig.of(horizon="2h"), EventTime())
    assert nxt.horizon_ms == 2 * HOUR and nxt.watermark > first.watermark, "the next batch moves"


def test_a_generation_holding_admitted_records_is_looked_up(redis_server):
    """Admission keeps records from the start of the floor bucket; a generation whose newest
    record is older than the watermark minus the horizon, but in that bucket, still holds
    records a copy of which would be admitted: it stays live."""
    client = redis_server.client()
    ks = _namespace(client)
    client.hset(ks.lanes, mapping={"t:0": NOW - HOUR})
    client.hset(ks.lane_activity, mapping={"t:0": NOW})
    config = DedupConfig.of(horizon="24h")
    first = fix_batch_params(client, ks, 1, 7, config, EventTime())
    oldest_admitted = first.floor * config.bucket_ms
    assert oldest_admitted < first.watermark - config.horizon_ms, "the bucket starts earlier"
    client.hset(ks.generations, mapping={3: oldest_admitted + 1})
    nxt = fix_batch_params(client, ks, 1, 8, config, EventTime())
    assert nxt.floor == first.floor
    assert 3 in nxt.live


def test_a_fenced_driver_cannot_fix_a_batch(redis_server):
    client = redis_server.client()
    ks = _namespace(client)
    client.incr(ks.epoch)  # a newer driver started
    with pytest.raises(FencedError):
        fix_batch_params(client, ks, 1, 0, DedupConfig(), EventTime())
