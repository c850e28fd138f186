"""The short torture run for CI: three random kill -9s of the whole run, messy input, one
final run, then the independent check (see ``torture.py``; run it longer with
``python -m tests.exactly_once.torture --minutes 10``).

The default suite runs it where the newest paths are: a Redis Cluster (``redis+cluster://``)
and the confluent-kafka client; the classic set-up (one Redis, kafka-python), which the rest of
the crash suite exercises point by point, runs it with ``--long``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from onceflow.kernel.settings import RedisSettings, redis_client
from onceflow.testing import LocalRedisCluster
from tests.exactly_once.torture import check, torture

pytestmark = [pytest.mark.crash, pytest.mark.kafka, pytest.mark.redis]


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[LocalRedisCluster]:
    cluster = LocalRedisCluster().start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.parametrize(
    "setup",
    ["redis-cluster+confluent", pytest.param("redis+kafka-python", marks=pytest.mark.long)],
)
def test_random_kills_and_messy_input_lose_and_duplicate_nothing(setup, broker, request, tmp_path):
    if setup == "redis-cluster+confluent":
        cluster = request.getfixturevalue("redis_cluster")
        url = "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in cluster.ports)
        client = "confluent"
    else:
        url = request.getfixturevalue("redis_server").url
        client = "python"
    # ~10 micro-batches per run, so each run outlasts the latest kill (the kill lands mid-run)
    t = torture(
        broker.bootstrap,
        url,
        str(tmp_path),
        seed=11,
        kills=3,
        wave=1500,
        cap=150,
        max_kill_s=18.0,
        client=client,
    )
    settings = RedisSettings(url)
    facts = check(t, redis_client(settings, t.run.name), lambda tag: redis_client(settings, tag))
    assert t.kills >= 2, f"the run ended before it could be killed: {facts}"
    assert facts["duplicates_dropped"] > 0 and facts["poison"] > 0
    reasons = set(t.run.poison.values())
    assert "further ahead of the clock" in reasons, "no days-ahead record in this seed's input"
