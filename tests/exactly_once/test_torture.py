"""The short torture run for CI: three random kill -9s of the whole run, messy input, one
final run, then the independent check (see ``torture.py``; run it longer with
``python -m tests.exactly_once.torture --minutes 10``).

The default suite runs it where the newest paths are: a Redis Cluster (``redis+cluster://``)
and the confluent-kafka client; the classic set-up (one Redis, kafka-python), which the rest of
the crash suite exercises point by point, runs it with ``--long``. Input without IDs (a
record's ID is its offset: the path that skips Bloom filters and seen-marks) runs by default
on one Redis with kafka-python.
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
    [
        "redis-cluster+confluent",
        "redis+kafka-python+positions",
        pytest.param("redis+kafka-python", marks=pytest.mark.long),
    ],
)
def test_random_kills_and_messy_input_lose_and_duplicate_nothing(setup, broker, request, tmp_path):
    if setup == "redis-cluster+confluent":
        cluster = request.getfixturevalue("redis_cluster")
        url = "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in cluster.ports)
        client = "confluent"
    else:
        url = request.getfixturevalue("redis_server").url
        client = "python"
    ids = "positions" if setup.endswith("+positions") else "mixed"
    # 4 micro-batches in the first run, 2-3 in the others: each outlasts its kill (<= 2 s after
    # its first new batch began), which lands among commits
    t = torture(
        broker.bootstrap,
        url,
        str(tmp_path),
        seed=11,
        kills=3,
        wave=1500,
        cap=400,
        max_kill_s=2.0,
        client=client,
        ids=ids,
    )
    settings = RedisSettings(url)
    facts = check(t, redis_client(settings, t.run.name), lambda tag: redis_client(settings, tag))
    assert t.kills >= 2, f"the run ended before it could be killed: {facts}"
    assert t.in_flight >= 2, f"the kills cut no micro-batch short: {facts}"
    assert facts["poison"] > 0
    if ids == "mixed":
        assert facts["duplicates_dropped"] > 0
    else:  # every re-sent copy had to count again
        assert facts["copy_ids"] > len({e["event_id"] for e in t.sent})
    reasons = set(t.run.poison.values())
    assert "further ahead of the clock" in reasons, "no days-ahead record in this seed's input"
