"""Change data capture end to end, exactly once: PostgreSQL -> Debezium -> Kafka -> Onceflow
-> a PostgreSQL table and an Iceberg table (upserts and deletes) and a Kafka topic
(tombstones).

A table of 300 rows is snapshotted, then inserts, updates and deletes of the same keys follow
in quick succession in small transactions, and one large transaction inserts and then updates
a block of rows. Kafka Connect is killed -9 mid-stream and started again (it re-sends what
came after its last stored offset: the test checks that it did), and the Onceflow run is
killed -9 (every process) at a random moment and run again. Then both copies must equal the
source table, and the output topic must hold one record per row change made in the database
(counted by the statements' row counts, not by the pipeline), each ID once.
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections import Counter

import pytest

from onceflow.connectors.kafka.admin import ensure_topics
from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import read_topic
from onceflow.kernel import ids
from onceflow.testing.harness import KillAfter, run_pipeline
from onceflow.testing.kafka_connect import LocalDebezium
from onceflow.testing.postgres import PASSWORD, USER
from tests.exactly_once.cdc_workload import END, SNAPSHOT, Workload, create_tables, read_both
from tests.exactly_once.test_changelog_sinks import iceberg_table

pytestmark = [pytest.mark.crash, pytest.mark.kafka, pytest.mark.redis]

PIPELINE = __file__.rsplit("/", 2)[0] + "/e2e_pipelines/cdc.py"
FLUSH_MS = 4000  # how often Connect stores its offsets: a kill re-sends what came after


def _wait_for_key(settings, topic: str, key: int, timeout: float = 120) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = read_topic(settings, topic)
        if any(r.key and json.loads(r.key)["payload"] == {"id": key} for r in records):
            return records
        time.sleep(0.5)
    pytest.fail(f"Debezium did not write the change of key {key} to {topic}")


def _identity(record) -> tuple:
    """A change's identity, read from the raw event (for counting Connect's re-sends)."""
    event = json.loads(record.value)["payload"]
    key = json.loads(record.key)["payload"]["id"]
    if event["op"] == "r":
        return ("r", key, json.dumps(event["after"], sort_keys=True))
    return (event["op"], key, event["source"]["lsn"], event["source"]["txId"])


@pytest.mark.parametrize(
    "large",
    [pytest.param(3_000, id="3k"), pytest.param(100_000, id="100k", marks=pytest.mark.long)],
)
def test_a_table_copied_through_debezium_is_identical_across_kill_9(
    broker, redis_server, postgres_server, tmp_path, large
):
    rng = random.Random(large)
    name = f"cdc-{uuid.uuid4().hex[:8]}"
    source, copy = f"src_{name[4:]}", f"dst_{name[4:]}"
    create_tables(postgres_server, source, copy)
    settings = KafkaSettings(broker.bootstrap)
    topic_in = f"{name}.public.{source}"
    ensure_topics(settings, [topic_in], 4)  # Debezium keys by primary key: a row's changes in order
    server = postgres_server.server
    database = ("127.0.0.1", server.port, "postgres", USER, PASSWORD)
    connect = LocalDebezium(
        broker.bootstrap, database, [f"public.{source}"], name, flush_ms=FLUSH_MS
    )
    workload = Workload(postgres_server, source, rng)
    try:
        connect.start()
        _wait_for_key(settings, topic_in, SNAPSHOT - 1)  # the snapshot is in Kafka
        # Connect stores the snapshot's offsets (else a restart takes a new snapshot, whose
        # reads of rows changed meanwhile are new events: tests/connectors/test_debezium.py)
        time.sleep(FLUSH_MS / 1000 + 1)

        def changes() -> None:
            workload.small(600)
            time.sleep(1.0)  # sent, and likely not yet stored as Connect's offset
            connect.kill()
            connect.start()
            workload.small(600)
            workload.large(large)
            workload.small(300)
            workload.end()

        writer = threading.Thread(target=changes)
        writer.start()
        env = {
            "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap,
            "CDC_PIPELINE": name,
            "CDC_IN": topic_in,
            "CDC_OUT": f"{name}-out",
            "CDC_ICEBERG": str(tmp_path / "iceberg"),
            "PG_TABLE": copy,
            **postgres_server.env,
        }
        args = ["--redis-url", redis_server.url, "--checkpoint", str(tmp_path / "ckpt")]
        args += ["--output-dir", str(tmp_path / "out"), "--max-records-per-batch", "500"]
        cut = KillAfter("] batch ", rng.uniform(1.0, 4.0))
        killed = run_pipeline(
            PIPELINE, [*args, "--trigger-seconds", "0"], env=env, kill_when=cut.when, echo=cut.echo
        )
        assert killed.crashed, killed.output[-3000:]
        writer.join(600)
        records = _wait_for_key(settings, topic_in, END, timeout=300)
    finally:
        connect.stop()
    ran = run_pipeline(PIPELINE, [*args, "--available-now"], env=env, timeout=900)
    assert ran.returncode == 0, ran.output[-3000:]

    events = [r for r in records if r.value is not None]
    resent = len(events) - len({_identity(r) for r in events})
    assert resent > 0, "Connect's restart re-sent nothing: the test did not test copies"
    want, got = read_both(postgres_server, source, copy)
    lake = iceberg_table(tmp_path / "iceberg").scan().to_arrow().to_pylist()
    assert sorted((r["id"], r["name"], r["score"]) for r in lake) == want, "the Iceberg copy"
    letters = read_topic(settings, f"{name}.dead-letters", committed=False)
    assert not letters, f"dead letters: {letters[0].value[:1500]!r}"
    assert got == want, f"the copy differs from the source table: {ran.output[-3000:]}"
    written: Counter[bytes] = Counter()
    tombstones = 0
    for record in read_topic(settings, f"{name}-out"):
        written[dict(record.headers)[ids.ID_HEADER]] += 1
        tombstones += record.value is None
    assert max(written.values()) == 1, "a change written twice"
    assert tombstones > 0
    made = SNAPSHOT + workload.changed
    assert sum(written.values()) == made, f"{sum(written.values())} records, {made} changes"
