"""Batch times from a Redis clock that lies: a clear stop, never state wiped or records refused.

The batch time decides when state with a ``ttl`` ends and which records are "ahead of the
clock"; it never goes back. A Redis clock a week ahead would end every week-long ``ttl`` at
once and for good; one an hour behind would dead-letter every record stamped now. Redis here
runs with its wall clock shifted (``onceflow.testing.preload.lying_clock``).
"""

from __future__ import annotations

import time

import pytest
import redis as redis_py

from onceflow.dedup.batch import fix_batch_params
from onceflow.dedup.clock import BatchClock, ClockSkewError
from onceflow.dedup.config import DedupConfig
from onceflow.kernel.eventtime import EventTime
from onceflow.kernel.keyspace import Keyspace
from onceflow.testing.preload import lying_clock

DAY = 86_400_000
HOUR = 3_600_000
NOW = 1_795_000_000_000


def test_clocks_that_disagree_stop_the_batch_saying_which_says_what():
    clock = BatchClock(60_000)
    with pytest.raises(ClockSkewError, match=r"8\.0 h ahead|192\.0 h ahead"):
        clock.now(NOW + 8 * DAY, 0, NOW)
    with pytest.raises(ClockSkewError, match="60 min behind"):
        clock.now(NOW - HOUR, 0, NOW)
    assert clock.now(NOW + 30_000, 0, NOW) == NOW + 30_000  # within the skew: Redis's time


def test_within_a_run_the_batch_time_moves_no_faster_than_time_really_passes():
    """Both clocks jumped a day ahead (one host): the batch time follows slowly."""
    clock = BatchClock(60_000)
    first = clock.now(NOW, 0, NOW)
    jumped = clock.now(NOW + DAY, first, NOW + DAY)
    assert first < jumped <= first + 60_000 + 5_000, jumped - first


def test_a_stored_time_ahead_of_the_clocks_holds_the_batch_time_still():
    clock = BatchClock(60_000)
    assert clock.now(NOW, NOW + 2 * HOUR, NOW) == NOW + 2 * HOUR  # never back


@pytest.mark.redis
@pytest.mark.parametrize("offset_ms", [8 * DAY, -HOUR], ids=["a-week-ahead", "an-hour-behind"])
def test_a_redis_whose_clock_lies_fixes_no_batch(redis_factory, offset_ms):
    server = redis_factory()
    server.stop()
    server.env = lying_clock(offset_ms)
    server.start()
    client = redis_py.Redis.from_url(server.url)
    redis_ms = int(client.time()[0]) * 1000
    # the lie is in place: Redis's clock is off by at least half of it, in its direction
    # (no bound on how long anything took)
    off = redis_ms - time.time() * 1000
    assert off * offset_ms > 0 and abs(off) > abs(offset_ms) / 2, "the clock does not lie"
    ks = Keyspace(f"clock-{offset_ms}")
    client.incr(ks.epoch)
    with pytest.raises(ClockSkewError, match="Fix the clock that is wrong"):
        fix_batch_params(client, ks, 1, 0, DedupConfig(), EventTime())
    assert not client.exists(ks.batch(0)) and not client.exists(ks.clock)
    lenient = EventTime.of(max_clock_skew="10d")  # told to accept it: it starts
    assert fix_batch_params(client, ks, 1, 0, DedupConfig(), lenient).time_ms >= redis_ms
