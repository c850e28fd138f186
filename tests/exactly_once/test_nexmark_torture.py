"""The stateful operators (user state and timers, windowed and continuous joins) under the
torture run's faults: Nexmark queries against their plain-Python reference
(``nexmark_torture.py``; ``test_nexmark_crashes.py`` kills them at fixed points instead).

The default suite runs one short round (q6: two process stages with state and timers,
killed once at a random moment); ``--long`` runs every stateful query with three random
kills, one with Redis's host crashing under it, one with the Kafka broker killed and restarted
mid-run. ``python -m
tests.exactly_once.nexmark_torture --query q8 --minutes 10`` keeps going.
"""

from __future__ import annotations

import pytest
import redis

from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.seen_layout import LAYOUT, LAYOUT_FIELD
from tests.exactly_once.nexmark_torture import check, nexmark_torture

pytestmark = [pytest.mark.crash, pytest.mark.kafka, pytest.mark.redis]


def _checked(nt) -> dict[str, int]:
    facts = check(nt)
    print(f"[nexmark torture] {nt.query}: {facts}")
    assert facts["kills"] >= 1, f"the run ended before it could be killed: {facts}"
    assert facts["poison"] > 0
    return facts


def test_a_stateful_query_killed_at_a_random_moment_gives_the_reference_once(
    broker, redis_server, tmp_path
):
    nt = nexmark_torture(
        "q6", broker.bootstrap, redis_server.url, str(tmp_path), seed=5, kills=1, wave=900
    )
    _checked(nt)


@pytest.mark.long
@pytest.mark.parametrize("query", ["q4", "q6", "q8", "q20", "early_bids"])
def test_random_kills_of_stateful_queries_lose_and_duplicate_nothing(
    query, broker, redis_server, tmp_path
):
    nt = nexmark_torture(
        query, broker.bootstrap, redis_server.url, str(tmp_path), seed=17, kills=3, wave=1500
    )
    facts = _checked(nt)
    assert facts["kills_mid_batch"] >= 1, f"the kills cut no micro-batch short: {facts}"


@pytest.mark.long
@pytest.mark.parametrize("query", ["q8", "q6"])
def test_redis_host_crashes_under_stateful_queries_lose_and_duplicate_nothing(
    query, broker, crashable_redis, tmp_path
):
    nt = nexmark_torture(
        query,
        broker.bootstrap,
        crashable_redis.url,
        str(tmp_path),
        seed=29,
        kills=2,
        wave=1500,
        min_kill_s=0.5,
        max_kill_s=2.0,
        redis_host=crashable_redis,
    )
    facts = _checked(nt)
    assert facts["redis_crashes"] >= 3, f"Redis crashed too rarely: {facts}"
    assert crashable_redis.lost_bytes() > 0, f"the crashes lost no acknowledged write: {facts}"


@pytest.mark.long
@pytest.mark.parametrize("query", ["q20", "early_bids"])
def test_a_broker_restart_under_stateful_queries_loses_and_duplicates_nothing(
    query, own_broker, redis_server, tmp_path
):
    """The broker killed and restarted in each attempt."""
    nt = nexmark_torture(
        query,
        own_broker.bootstrap,
        redis_server.url,
        str(tmp_path),
        seed=31,
        kills=2,
        wave=1500,
        cap=100,  # the last attempt, never killed, outlasts its broker's restart
        min_kill_s=8.0,
        max_kill_s=12.0,
        broker=own_broker,
    )
    facts = _checked(nt)
    meta = redis.Redis.from_url(redis_server.url).hget(Keyspace(nt.run.name).meta, LAYOUT_FIELD)
    assert int(meta or 0) == LAYOUT, f"the namespace's seen-ID layout is {meta!r}"
    assert facts["broker_restarts"] >= 2, f"the broker was restarted too rarely: {facts}"
    assert facts["broker_restarts_ridden_out"], f"the last run ended before the restart: {facts}"
