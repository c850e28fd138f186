"""Upserts and deletes reach an Iceberg table exactly once across kill -9.

Sets and deletes of 40 users in quick succession (a user's events in order on its partition,
5% re-sent later), a run killed -9 at a random moment mid-stream and a rerun; the table, read
with pyiceberg's own scan, must equal an independent replay of the events sent: each user's
last state, a deleted user absent, one row per user. A delivery whose commit landed before the
kill and was applied again by the rerun would bring back a deleted user or an older total; one
applied in part would leave a user twice.
"""

from __future__ import annotations

import json
import random
import uuid

import pytest

from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import produce
from onceflow.testing.harness import KillAfter, run_pipeline
from tests.exactly_once.test_changelog_sinks import (
    _changes,
    _expected,
    check_iceberg,
    iceberg_table,
)

pytest.importorskip("pyiceberg")
pytestmark = [pytest.mark.crash, pytest.mark.kafka, pytest.mark.redis]

PIPELINE = __file__.rsplit("/", 2)[0] + "/e2e_pipelines/iceberg_changes.py"


# CI time: the default suite's changelog test writes the same table in the same run as its
# PostgreSQL and Kafka sinks (test_changelog_sinks.py); this kill schedule runs with --long
@pytest.mark.long
def test_upserts_and_deletes_reach_an_iceberg_table_once_across_kill_9(
    broker, redis_server, tmp_path
):
    rng = random.Random(4141)
    name = f"ice-{uuid.uuid4().hex[:8]}"
    events = _changes(rng, 3000)
    sends = list(events)
    for e in rng.sample(events[:2000], 150):  # re-sent later, out of order: copies
        sends.insert(rng.randrange(sends.index(e) + 1, len(sends) + 1), e)
    settings = KafkaSettings(broker.bootstrap)
    topic_in = f"{name}-in"
    records = [(e["user"].encode(), json.dumps(e).encode(), None) for e in sends]
    produce(settings, topic_in, records, partitions=4)  # by user: a user's changes in order
    folder = tmp_path / "iceberg"
    env = {
        "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap,
        "CHG_PIPELINE": name,
        "CHG_IN": topic_in,
        "CHG_ICEBERG": str(folder),
    }
    args = ["--redis-url", redis_server.url, "--checkpoint", str(tmp_path / "ckpt")]
    args += ["--output-dir", str(tmp_path / "out"), "--max-records-per-batch", "250"]
    # mid-stream, mid-batch: after a random micro-batch and up to 1.5 s
    cut = KillAfter("] batch ", rng.uniform(0.0, 1.5), nth=rng.randrange(1, 6))
    killed = run_pipeline(
        PIPELINE, [*args, "--trigger-seconds", "0"], env=env, kill_when=cut.when, echo=cut.echo
    )
    assert killed.crashed, killed.output[-3000:]
    table = iceberg_table(folder)
    before = len(table.metadata.snapshots)
    ran = run_pipeline(PIPELINE, [*args, "--available-now"], env=env)
    assert ran.returncode == 0, ran.output[-3000:]

    expected = _expected(events)
    assert 0 < len(expected) < 40, "some users end deleted, some not"
    table.refresh()
    assert len(table.metadata.snapshots) > before > 1, "the kill came after commits, mid-stream"
    check_iceberg(table, expected)
