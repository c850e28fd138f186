"""Scenario helpers for the real-input tests: produce as real producers do, verify independently.

Producers here are plain kafka-python producers (no Onceflow code): IDs in headers as text or
bytes, Kafka timestamps set by the test (re-sends hours later), chosen partitions. ``verify``
counts the input itself and compares the pipeline's keyed state, the totals topic (the last
total of every user), the copy topic (one ID per event, one value per ID) and the dead
letters (exactly the expected poison records, each with its reason).
"""

from __future__ import annotations

import json
import os
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from kafka import KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic

from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.sink import ERROR_HEADER
from onceflow.connectors.kafka.topics import read_topic
from onceflow.kernel import codec
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.scopes import node_state
from onceflow.testing.harness import compare_counts

PIPELINE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "e2e_pipelines", "totals.py")


@dataclass
class Send:
    """One record as a producer sends it."""

    value: dict[str, Any] | bytes
    partition: int = 0
    headers: list[tuple[str, bytes]] | None = None
    timestamp_ms: int | None = None


@dataclass
class Run:
    """One pipeline's topics, settings and the independent count of what it should do."""

    name: str
    bootstrap: str
    redis_url: str
    workdir: str
    partitions: int = 2
    expected: Counter[str] = field(default_factory=Counter)  # user -> total amount
    events: Counter[str] = field(default_factory=Counter)  # event_id -> copies it must make
    poison: dict[str, str] = field(default_factory=dict)  # event_id or marker -> reason part
    sizes: dict[str, int] = field(default_factory=dict)  # event_id -> its body's length, if any
    produced: int = 0  # records sent to the input topic (events, copies, poison)
    extra_env: dict[str, str] = field(default_factory=dict)
    cap: int = 1000
    extra_args: list[str] = field(default_factory=list)  # more options of onceflow run

    @property
    def topics(self) -> dict[str, str]:
        return {k: f"{self.name}-{k}" for k in ("in", "copy", "totals")}

    @property
    def env(self) -> dict[str, str]:
        t = self.topics
        return {
            "KAFKA_BOOTSTRAP_SERVERS": self.bootstrap,
            "TOTALS_PIPELINE": self.name,
            "TOTALS_IN": t["in"],
            "TOTALS_COPY": t["copy"],
            "TOTALS_OUT": t["totals"],
            **self.extra_env,
        }

    def args(self, checkpoint: str = "checkpoint") -> list[str]:
        return [
            "--available-now",
            "--max-records-per-batch",
            str(self.cap),
            "--redis-url",
            self.redis_url,
            "--checkpoint",
            os.path.join(self.workdir, checkpoint),
            "--output-dir",
            os.path.join(self.workdir, "out"),
            "--master",
            "local[2,4]",
            "--no-progress",
            *self.extra_args,
        ]

    def produce(self, sends: list[Send]) -> None:
        admin = KafkaAdminClient(bootstrap_servers=self.bootstrap)
        try:
            admin.create_topics([NewTopic(self.topics["in"], self.partitions, -1)])
        except Exception:  # noqa: BLE001 - exists already (a second produce)
            pass
        finally:
            admin.close()
        producer = KafkaProducer(bootstrap_servers=self.bootstrap, acks="all", linger_ms=5)
        for s in sends:
            value = s.value if isinstance(s.value, bytes) else json.dumps(s.value).encode()
            producer.send(
                self.topics["in"],
                value=value,
                headers=s.headers,
                timestamp_ms=s.timestamp_ms,
                partition=s.partition,
            )
        producer.flush(60)
        producer.close()
        self.produced += len(sends)


def new_run(broker, redis_url, tmp_path, partitions: int = 2, **env: str) -> Run:
    name = f"real-{uuid.uuid4().hex[:8]}"
    return Run(name, broker.bootstrap, redis_url, str(tmp_path), partitions, extra_env=env)


def event(run: Run, user: str, amount: int, **more: Any) -> dict[str, Any]:
    """A new event, counted in the expectation (its ``body``'s length too, if it has one)."""
    e = {"event_id": str(uuid.uuid4()), "user": user, "amount": amount, **more}
    run.expected[user] += amount
    run.events[e["event_id"]] += 1
    if "body" in more:  # a document: every sink must hold it whole
        run.sizes[e["event_id"]] = len(more["body"])
    return e


def verify(run: Run, client: Any, connect: Any = None) -> dict[str, int]:
    """Compare everything the pipeline did with the independent count; return facts.

    ``connect`` gives the clients of partition scopes on a Redis Cluster.
    """
    settings = KafkaSettings(run.bootstrap)
    stored = node_state(client, run.name, "total", connect)
    state: dict[str, int] = {codec.decode(k): codec.decode(v) for k, v in stored.items()}
    report = compare_counts(run.expected, state)
    assert report.ok, f"keyed state: {report}"
    last: dict[str, tuple[int, int]] = {}
    by_id: dict[bytes, set[bytes]] = defaultdict(set)
    for rec in read_topic(settings, run.topics["totals"]):
        user = (rec.key or b"").decode()
        by_id[rec.headers["onceflow-id"]].add(rec.value or b"")
        if rec.offset >= last.get(user, (-1, 0))[0]:
            last[user] = (rec.offset, json.loads(rec.value or b"0"))
    report = compare_counts(run.expected, {u: v for u, (_, v) in last.items()})
    assert report.ok, f"totals topic (each user's last total): {report}"
    assert all(len(v) == 1 for v in by_id.values()), "a totals ID was written with two values"
    copies: dict[bytes, set[bytes]] = defaultdict(set)
    raw = 0
    for rec in read_topic(settings, run.topics["copy"]):
        copies[rec.headers["onceflow-id"]].add(rec.value or b"")
        raw += 1
    assert all(len(v) == 1 for v in copies.values()), "a copy ID was written with two values"
    values = [json.loads(next(iter(v))) for v in copies.values()]
    report = compare_counts(run.events, Counter(e["event_id"] for e in values))
    assert report.ok, f"copy topic: {report}"
    check_sizes(run, "copy topic", ((e["event_id"], e.get("body")) for e in values))
    if run.extra_env.get("TOTALS_PLAIN_SINK") != "1":  # transactional: each record once
        assert raw == len(copies), f"copy topic: {raw - len(copies)} records read twice"
    facts = _verify_table_sinks(run)
    dead = dead_letters(run)
    for marker, reason in run.poison.items():
        found = [d for d in dead if marker in d["text"]]
        assert len(found) == 1, f"dead letter for {marker!r}: {len(found)} found in {dead}"
        assert reason in found[0]["error"], f"reason {found[0]['error']!r} lacks {reason!r}"
    assert len(dead) == len(run.poison), f"unexpected dead letters: {dead}"
    return {"copy_records": raw, "copy_ids": len(copies), "dead_letters": len(dead), **facts}


SINKS = ("parquet", "jsonl", "iceberg", "postgres")  # beside the Kafka sinks, by sinks_env


def sinks_env(
    workdir: str, sinks: tuple[str, ...] = SINKS, postgres: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment that makes totals.py write to ``sinks`` too, under ``workdir``;
    ``postgres`` (``PG_CONNINFO``, ``PGPASSWORD``): the server of a table made here."""
    unknown = set(sinks) - set(SINKS)
    if unknown:
        raise ValueError(f"unknown sinks {sorted(unknown)}; use some of {SINKS}")
    env = {}
    for sink, variable in (
        ("parquet", "TOTALS_PARQUET"),
        ("jsonl", "TOTALS_JSONL"),
        ("iceberg", "TOTALS_ICEBERG"),
    ):
        if sink in sinks:
            env[variable] = os.path.join(workdir, sink)
    if "postgres" in sinks:
        if postgres is None:
            raise ValueError("the postgres sink needs a server: pass postgres=")
        import psycopg

        table = f"totals_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(
            postgres["PG_CONNINFO"], password=postgres["PGPASSWORD"], autocommit=True
        ) as conn:
            conn.execute(
                f'CREATE TABLE {table} (event_id text, "user" text, amount int, body text)'
            )
        env.update(TOTALS_PG_TABLE=table, **postgres)
    return env


def _verify_table_sinks(run: Run) -> dict[str, int]:
    """The other sinks, each read back by a reader of its own that knows nothing of Onceflow
    (pyarrow, psycopg, pyiceberg, plain file reads): each event once, its document whole."""
    readers = {
        "TOTALS_PARQUET": ("Parquet files", "parquet_rows", read_parquet),
        "TOTALS_PG_TABLE": ("PostgreSQL table", "postgres_rows", read_postgres),
        "TOTALS_ICEBERG": ("Iceberg table", "iceberg_rows", read_iceberg),
        "TOTALS_JSONL": ("JSON-lines files", "jsonl_rows", read_json_lines),
    }
    facts = {}
    for variable, (what, fact, read) in readers.items():
        where = run.extra_env.get(variable)
        if not where:
            continue
        rows = read(where, run.extra_env)
        report = compare_counts(run.events, Counter(eid for eid, _body in rows))
        assert report.ok, f"{what}: {report}"
        check_sizes(run, what, rows)
        facts[fact] = len(rows)
    return facts


Row = tuple[str, "str | None"]  # an event's ID and its document (None: none)


def check_sizes(run: Run, what: str, rows: Any) -> None:
    """Every event's document as long as sent (a cut or swapped one fails), none elsewhere."""
    wrong = [
        (eid, len(body or ""), run.sizes.get(eid, 0))
        for eid, body in rows
        if len(body or "") != run.sizes.get(eid, 0)
    ]
    assert not wrong, f"{what}: documents of other lengths (event, read, sent): {wrong[:5]}"


def read_parquet(folder: str, _env: dict[str, str]) -> list[Row]:
    """Every Parquet file of the folder, by pyarrow (files of a delivery without documents
    have no ``body`` column)."""
    import pyarrow.dataset as ds

    rows: list[Row] = []
    for fragment in ds.dataset(folder, format="parquet").get_fragments():
        names = fragment.physical_schema.names
        table = fragment.to_table(columns=[c for c in ("event_id", "body") if c in names])
        bodies = table.column("body").to_pylist() if "body" in names else [None] * len(table)
        rows += zip(table.column("event_id").to_pylist(), bodies, strict=True)
    return rows


def read_postgres(table: str, env: dict[str, str]) -> list[Row]:
    """The table's rows, by psycopg."""
    import psycopg

    with psycopg.connect(env["PG_CONNINFO"], password=env["PGPASSWORD"]) as conn:
        return [(e, b) for e, b in conn.execute(f"SELECT event_id, body FROM {table}")]


ICEBERG_TABLE = "onceflow.events"  # the table totals.py writes (TOTALS_ICEBERG)


def iceberg_catalog(folder: str) -> dict[str, str]:
    """A SQL catalog (SQLite) and warehouse in ``folder``: totals.py's and its reader's."""
    os.makedirs(os.path.join(folder, "warehouse"), exist_ok=True)
    return {
        "type": "sql",
        "uri": f"sqlite:///{os.path.join(folder, 'catalog.db')}",
        "warehouse": f"file://{os.path.join(folder, 'warehouse')}",
    }


def read_iceberg(folder: str, _env: dict[str, str]) -> list[Row]:
    """The table's current snapshot, by pyiceberg, from a catalog opened anew."""
    from pyiceberg.catalog import load_catalog

    table = load_catalog("default", **iceberg_catalog(folder)).load_table(ICEBERG_TABLE)
    arrow = table.scan(selected_fields=("event_id", "body")).to_arrow()
    return list(zip(*(arrow.column(c).to_pylist() for c in ("event_id", "body")), strict=True))


def read_json_lines(folder: str, _env: dict[str, str]) -> list[Row]:
    """Every committed part file (``part-*``, not the staging folder), by plain reads; each
    line's ``id`` once (an ID on two lines is a record written twice)."""
    rows: list[Row] = []
    seen: Counter[str] = Counter()
    for name in sorted(os.listdir(folder)):
        if not name.startswith("part-"):
            continue
        with open(os.path.join(folder, name), encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    record = json.loads(line)
                    seen[record["id"]] += 1
                    rows.append((record["value"]["event_id"], record["value"].get("body")))
    twice = {i: n for i, n in seen.items() if n > 1}
    assert not twice, f"JSON-lines files: {len(twice)} IDs on more than one line"
    return rows


def dead_letters(run: Run) -> list[dict[str, str]]:
    """The pipeline's dead-letter topic: each letter's error and its payload as text."""
    topic = f"{run.name}.dead-letters"
    try:
        records = read_topic(KafkaSettings(run.bootstrap), topic)
    except Exception:  # noqa: BLE001 - no dead letter was ever written
        return []
    letters: dict[bytes, dict[str, str]] = {}
    for rec in records:
        key = rec.headers.get("onceflow-id", str(rec.offset).encode())
        letters[key] = {
            "error": rec.headers.get(ERROR_HEADER, b"").decode(errors="replace"),
            "text": (rec.value or b"").decode(errors="replace"),
        }
    return list(letters.values())


def stats(client: Any, run: Run, receiver: str = "events") -> dict[str, int]:
    return {
        k.decode(): int(v) for k, v in client.hgetall(Keyspace(run.name).stats(receiver)).items()
    }
