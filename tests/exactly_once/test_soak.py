"""The soak's rounds (``soak.py``): its faults interleaved, each round checked exact.

The default suite runs one short round where the soak's newest fault is: the README
pipeline's shape with messy input and every file sink, in one run to its end on a Redis
Cluster one of whose masters fails over at a random moment, with the broker killed -9 and
restarted at another (``test_torture.py`` and ``test_nexmark_torture.py`` kill -9 runs and
crash Redis's host by default). ``--long`` runs a round of each workload on each Redis (a
Redis 8 whose host crashes, the cluster), each with kill -9s, and writes the result as the
soak does (JSON and the page's section) to check both. ``python -m
tests.exactly_once.soak --minutes 60`` is the soak itself.
"""

from __future__ import annotations

import json

import pytest

from tests.exactly_once.soak import HEADING, Services, soak, write_result

pytestmark = [pytest.mark.crash, pytest.mark.kafka, pytest.mark.redis, pytest.mark.cluster]


def test_a_soak_round_with_a_cluster_failover_and_a_broker_restart_is_exact(
    own_broker, redis_cluster
):
    services = Services(own_broker, redis_cluster, None)
    tally = soak(services, minutes=30, seed=71, rounds=1, kills=0, wave=900, workloads=("totals",))
    print(f"[soak] {tally.line()}")
    assert not tally.anomalies, tally.anomalies
    assert tally.done["Redis Cluster failovers"] == 1, tally.line()
    assert tally.done["broker restarts"] == 1, tally.line()


@pytest.mark.long
def test_a_soak_of_every_workload_on_every_redis_is_exact(
    own_broker, redis_cluster, crashable_factory, postgres_server, tmp_path
):
    services = Services(own_broker, redis_cluster, crashable_factory, postgres_server.env)
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\n## The other benchmarks\n\nhand-written\n")
    result = tmp_path / "soak.json"
    tally = soak(
        services,
        minutes=60,
        seed=73,
        rounds=6,
        result=lambda t: write_result(t, "soak test", str(result), str(page)),
    )
    print(f"[soak] {tally.line()}")
    assert not tally.anomalies, tally.anomalies
    assert len(tally.rounds) == 6, f"each workload on each Redis once: {tally.rounds}"
    for fault in ("Redis Cluster failovers", "Redis host crashes", "broker restarts"):
        assert tally.done[fault] >= 3, tally.line()
    written = json.loads(result.read_text())
    assert written["anomalies"] == [] and written["records"] == tally.records > 0
    text = page.read_text()
    assert HEADING in text and "| anomalies | 0 |" in text
    assert text.index(HEADING) < text.index("## The other benchmarks")
