"""Deletes reach the sinks exactly once: a PostgreSQL and an Iceberg upsert delete, Kafka gets
tombstones.

Sets and deletes of the same users in quick succession (a key's events in order on its
partition, 5% re-sent later), a run killed -9 at a random moment mid-stream and a rerun. The
tables and the topic's compacted view (last record per key, a tombstone removing it) must
equal an independent replay of the events sent: each user's last event, a delete leaving no
row.
"""

from __future__ import annotations

import json
import random
import uuid
from collections import Counter

import pytest

from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import produce, read_topic
from onceflow.kernel import ids
from onceflow.testing.harness import KillAfter, run_pipeline

pytestmark = [pytest.mark.crash, pytest.mark.kafka, pytest.mark.redis]

PIPELINE = __file__.rsplit("/", 2)[0] + "/e2e_pipelines/changes.py"
BASE_TS = 1_700_000_000_000


def _changes(rng: random.Random, n: int) -> list[dict]:
    out = []
    for i in range(n):
        op = "delete" if rng.random() < 0.3 else "set"
        user = f"u{rng.randrange(40)}"
        out.append(
            {"event_id": uuid.uuid4().hex, "user": user, "op": op, "total": i, "ts": BASE_TS + i}
        )
    return out


def _expected(events: list[dict]) -> dict[str, int]:
    state: dict[str, int] = {}
    for e in events:
        if e["op"] == "delete":
            state.pop(e["user"], None)
        else:
            state[e["user"]] = e["total"]
    return state


def iceberg_table(folder):
    """The onceflow.users table of the SQL catalog (SQLite) in ``folder``."""
    from pyiceberg.catalog import load_catalog

    catalog = load_catalog(
        "default",  # the sink's catalog_name: a SQL catalog keeps its tables under it
        type="sql",
        uri=f"sqlite:///{folder}/catalog.db",
        warehouse=f"file://{folder}/warehouse",
    )
    return catalog.load_table("onceflow.users")


def check_iceberg(table, expected: dict[str, int]) -> None:
    """The table holds each user's last state, one row each, no delivery committed twice."""
    from onceflow.connectors.iceberg_snapshots import DELIVERY

    rows = table.scan().to_arrow().to_pylist()
    users = [r["key"] for r in rows]
    assert len(users) == len(set(users)), "a user has two rows"
    assert {r["key"]: r["total"] for r in rows} == expected, "the table is not the last state"
    deliveries = [
        s.summary.additional_properties[DELIVERY]
        for s in table.metadata.snapshots
        if DELIVERY in s.summary.additional_properties
    ]
    assert len(deliveries) == len(set(deliveries)), "a delivery committed twice"


def test_deletes_reach_a_table_and_a_compacted_topic_once_across_kill_9(
    broker, redis_server, postgres_server, tmp_path
):
    rng = random.Random(41)
    name = f"chg-{uuid.uuid4().hex[:8]}"
    table = f"t_{name.replace('-', '_')}"
    with postgres_server.connect() as conn:
        conn.execute(f"CREATE TABLE {table} (key text PRIMARY KEY, total bigint)")
    events = _changes(rng, 3000)
    sends = list(events)
    for e in rng.sample(events[:2000], 150):  # re-sent later, out of order: copies
        sends.insert(rng.randrange(sends.index(e) + 1, len(sends) + 1), e)
    settings = KafkaSettings(broker.bootstrap)
    topic_in = f"{name}-in"
    records = [(e["user"].encode(), json.dumps(e).encode(), None) for e in sends]
    produce(settings, topic_in, records, partitions=4)  # by user: a user's changes in order
    env = {
        "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap,
        "CHG_PIPELINE": name,
        "CHG_IN": topic_in,
        "CHG_OUT": f"{name}-out",
        "PG_TABLE": table,
        "CHG_ICEBERG": str(tmp_path / "iceberg"),
        **postgres_server.env,
    }
    args = ["--redis-url", redis_server.url, "--checkpoint", str(tmp_path / "ckpt")]
    args += ["--output-dir", str(tmp_path / "out"), "--max-records-per-batch", "150"]
    cut = KillAfter("] batch ", rng.uniform(1.0, 3.0))
    killed = run_pipeline(
        PIPELINE, [*args, "--trigger-seconds", "0"], env=env, kill_when=cut.when, echo=cut.echo
    )
    assert killed.crashed, killed.output[-3000:]
    ran = run_pipeline(PIPELINE, [*args, "--available-now"], env=env)
    assert ran.returncode == 0, ran.output[-3000:]

    expected = _expected(events)
    assert 0 < len(expected) < 40, "some users end deleted, some not"
    with postgres_server.connect() as conn:
        rows = dict(conn.execute(f"SELECT key, total FROM {table}").fetchall())
    assert rows == expected, "the table is not the events' last state"
    check_iceberg(iceberg_table(tmp_path / "iceberg"), expected)
    compacted: dict[str, int] = {}
    tombstones = 0
    written: Counter[bytes] = Counter()
    for record in read_topic(settings, f"{name}-out"):
        written[dict(record.headers)[ids.ID_HEADER]] += 1
        key = record.key.decode()
        if record.value is None:
            tombstones += 1
            compacted.pop(key, None)
        else:
            compacted[key] = json.loads(record.value)["total"]
    assert tombstones > 0 and compacted == expected
    assert max(written.values()) == 1, "a record written twice"
    assert len(written) == len(events), "every distinct event wrote one record"
