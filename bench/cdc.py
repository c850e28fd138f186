"""Change records per second through the CDC pipeline beside the plain Kafka pipeline, one run.

The CDC pipeline is the one of ``tests/e2e_pipelines/cdc.py``: PostgreSQL -> Debezium (Kafka
Connect) -> Kafka -> Onceflow, ``KafkaSource(topic, format="debezium")`` -> key by the row's
primary key -> the row (None once deleted) -> a transactional Kafka topic, exactly-once.

The input: ``--changes`` row changes of one table ``(id, name, score, note)`` (a 60-byte
note) counted by the database's own row counts: a fifth of them rows that exist before
Debezium starts (its snapshot), then, in transactions of ``--tx-rows`` rows, inserts (two
fifths), updates (a quarter) and deletes (the rest). Debezium (``LocalDebezium``: Kafka
Connect 4.3 standalone, Debezium 3.6.1's PostgreSQL connector, pgoutput) writes them to a
topic of 2 partitions; the benchmark waits until every change (and each delete's tombstone)
is in the topic and prints how long that took, for information: Connect's start, the
snapshot, and the streamed changes from the first write to the last event in Kafka. Connect
is then stopped: it does not compete with the measured runs.

The baseline, the plain Kafka pipeline: the same changes as plain JSON, one record per
change ``{"n", "op", "id", "after"}`` (``after``: the row as Debezium wrote it, None for a
delete; ``n``: its place in the topic, the record's ID through ``id=``) with the same keys
on the same partitions, through the same pipeline shape (key by ``id``, the ``after`` row,
the same sink) without ``format="debezium"``. Both sides take an ID from every record (all
of them through the Bloom filters and Redis) and write the same output.

``--converters``: ``schemas`` (Kafka Connect's ``JsonConverter`` with schemas, the default
a user gets: every key and value wrapped as ``{"schema", "payload"}``) and/or ``no-schemas``
(``schemas.enable=false``); each its own table, the same changes, its own Debezium run.

Runs: one Spark session, one warm-up run (not counted), then ``--repeat`` rounds, in each
every pipeline once in a rotating order, each with a fresh checkpoint and namespace, reading
its topic from the start (``--available-now``). After each run an outside reader
(``read_committed``) checks the output topic: one record per change, each ID once, and the
same keys and values as every other pipeline's output (*exact*).

Prints records/s (whole run, and steady state without the query's first micro-batch), the
median and the spread (min–max) over the rounds, the ratio to the plain pipeline, and the
input's bytes per record.

    python bench/cdc.py [--changes 100000] [--batch 25000] [--repeat 3] [--tx-rows 1000]
        [--converters schemas,no-schemas] [--markdown FILE]

Uses REDIS_URL / KAFKA_BOOTSTRAP_SERVERS when set, else starts local ones; always starts its
own PostgreSQL (Debian's) and Kafka Connect (fetched from Maven Central on first use).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import page  # noqa: E402
from exactly_once import services  # noqa: E402
from teardown import started  # noqa: E402

from onceflow import KafkaSink, KafkaSource, Pipeline  # noqa: E402
from onceflow.connectors.kafka.admin import ensure_topics  # noqa: E402
from onceflow.connectors.kafka.connection import KafkaSettings  # noqa: E402
from onceflow.connectors.kafka.topics import TopicRecord, produce, read_topic  # noqa: E402
from onceflow.kernel import ids  # noqa: E402
from onceflow.runtime.spark_env.session import DEFAULT_MASTER, spark_session  # noqa: E402
from onceflow.testing.kafka_connect import LocalDebezium  # noqa: E402
from onceflow.testing.postgres import PASSWORD, USER, LocalPostgres  # noqa: E402

SECTION = "## Change data capture"
PARTITIONS = 2
PLAIN = "plain"
JSON_CONVERTER = "org.apache.kafka.connect.json.JsonConverter"
CONVERTERS: dict[str, dict[str, str]] = {
    "schemas": {},  # Connect's default: JsonConverter with schemas
    "no-schemas": {
        "key.converter": JSON_CONVERTER,
        "key.converter.schemas.enable": "false",
        "value.converter": JSON_CONVERTER,
        "value.converter.schemas.enable": "false",
    },
}
NOTE = "n" * 60  # a row's text column, so that a row is not three numbers
CAPTURE_TIMEOUT_S = 600.0


@dataclass
class Capture:
    """One Debezium topic of the workload's changes, and how long Debezium took."""

    converter: str
    topic: str
    changes: int  # row changes made, by the database's row counts
    deletes: int
    seconds: dict[str, float] = field(default_factory=dict)


def connect_to(pg: LocalPostgres) -> Any:
    import psycopg

    return psycopg.connect(pg.conninfo, password=PASSWORD, autocommit=True)


def split(changes: int) -> tuple[int, int, int, int]:
    """``(snapshot, inserts, updates, deletes)`` adding up to ``changes`` (see the module)."""
    snapshot, inserts, updates = changes // 5, changes * 2 // 5, changes // 4
    return snapshot, inserts, updates, changes - snapshot - inserts - updates


def create_table(pg: LocalPostgres, table: str, snapshot: int) -> int:
    """The table with its first ``snapshot`` rows; the rows inserted."""
    with connect_to(pg) as conn:
        conn.execute(
            f"CREATE TABLE {table} (id int PRIMARY KEY, name text, score bigint, note text)"
        )
        cur = conn.execute(
            f"INSERT INTO {table} SELECT g, 'n' || g, 0, %s FROM generate_series(0, %s::int) g",
            (NOTE, snapshot - 1),
        )
        return cur.rowcount


def write_changes(pg: LocalPostgres, table: str, changes: int, tx_rows: int) -> tuple[int, int]:
    """Inserts, then updates, then deletes, ``tx_rows`` per transaction: (rows changed, deletes).

    Updates change the oldest rows, deletes the next ones: every statement finds its rows.
    """
    snapshot, inserts, updates, deletes = split(changes)
    statements = [
        (f"INSERT INTO {table} SELECT g, 'n' || g, 1, %s FROM generate_series(%s::int, %s::int) g",
         snapshot, snapshot + inserts, True),
        (f"UPDATE {table} SET score = score + 1 WHERE id >= %s AND id <= %s", 0, updates, False),
        (f"DELETE FROM {table} WHERE id >= %s AND id <= %s", updates, updates + deletes, False),
    ]  # fmt: skip
    changed = deleted = 0
    with connect_to(pg) as conn:
        for sql, first, end, note in statements:
            for lo in range(first, end, tx_rows):
                hi = min(end, lo + tx_rows) - 1
                with conn.transaction():
                    rows = conn.execute(sql, (NOTE, lo, hi) if note else (lo, hi)).rowcount
                changed += rows
                deleted += rows if sql.startswith("DELETE") else 0
    return changed, deleted


def topic_size(settings: KafkaSettings, topic: str) -> int:
    """Records written to ``topic`` so far (Debezium writes without transactions)."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(**settings.client_config())
    try:
        parts = consumer.partitions_for_topic(topic) or set()
        ends = consumer.end_offsets([TopicPartition(topic, p) for p in parts])
        return sum(ends.values())
    finally:
        consumer.close()


def wait_for(settings: KafkaSettings, topic: str, records: int, connect: LocalDebezium) -> None:
    """Until ``topic`` holds ``records`` records; a clear error if Connect stops or stalls."""
    deadline = time.monotonic() + CAPTURE_TIMEOUT_S
    while (found := topic_size(settings, topic)) < records:
        if not connect.running or time.monotonic() > deadline:
            msg = f"Debezium wrote {found:,} of {records:,} records to {topic}"
            msg += f" (see {connect.log_path})"
            raise RuntimeError(msg)
        time.sleep(0.2)


def capture(
    pg: LocalPostgres, bootstrap: str, converter: str, changes: int, tx_rows: int
) -> Capture:
    """The workload's changes made in a new table and captured by Debezium into a topic."""
    prefix = f"cdc{uuid.uuid4().hex[:6]}"
    table = f"rows_{prefix}"
    settings = KafkaSettings(bootstrap)
    topic = f"{prefix}.public.{table}"
    ensure_topics(settings, [topic], PARTITIONS)  # Debezium keys by primary key
    snapshot = create_table(pg, table, split(changes)[0])
    database = ("127.0.0.1", pg.port, "postgres", USER, PASSWORD)
    with contextlib.ExitStack() as stack:
        t0 = time.perf_counter()
        connect = started(
            stack,
            LocalDebezium(bootstrap, database, [f"public.{table}"], prefix, CONVERTERS[converter]),
        )
        t1 = time.perf_counter()
        wait_for(settings, topic, snapshot, connect)
        t2 = time.perf_counter()
        streamed, deletes = write_changes(pg, table, changes, tx_rows)
        t3 = time.perf_counter()
        wait_for(settings, topic, snapshot + streamed + deletes, connect)  # + tombstones
        t4 = time.perf_counter()
    with connect_to(pg) as conn:  # an inactive slot would keep the server's WAL forever
        conn.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            "WHERE slot_name = %s",
            (f"{prefix}_slot",),
        )
    seconds = {"start": t1 - t0, "snapshot": t2 - t1, "writes": t3 - t2, "streamed": t4 - t2}
    return Capture(converter, topic, snapshot + streamed, deletes, seconds)


def _key_id(key: bytes) -> int:
    """The ``id`` of a Debezium key, with or without its schema."""
    document = json.loads(key)
    return int(document.get("payload", document)["id"])


def plain_copy(settings: KafkaSettings, debezium_topic: str) -> tuple[str, int]:
    """The baseline's topic: each change as plain JSON, same keys and partitions (the module)."""
    events = [r for r in read_topic(settings, debezium_topic, timeout=300) if r.value is not None]
    topic = f"cdc-plain-{uuid.uuid4().hex[:6]}"
    values = []
    for n, r in enumerate(events):
        assert r.key is not None and r.value is not None
        event = json.loads(r.value)
        event = event.get("payload", event)
        row = {"n": n, "op": event["op"], "id": _key_id(r.key), "after": event["after"]}
        values.append((str(row["id"]).encode(), json.dumps(row).encode(), None))
    produce(
        settings,
        topic,
        values,
        partitions=PARTITIONS,
        partitioner=lambda n, _k: events[n].partition,
    )
    return topic, len(values)


def build(kind: str, name: str, topic: str, bootstrap: str) -> Pipeline:
    """The measured pipeline: Debezium's changes or the plain records, by key, the row, a topic."""
    p = Pipeline(name)
    if kind == PLAIN:
        rows = (
            p.read("changes", KafkaSource(topic, bootstrap_servers=bootstrap, id=itemgetter("n")))
            .key_by("by-id", itemgetter("id"))
            .map_values("row", itemgetter("after"))
        )
    else:
        rows = (
            p.read("changes", KafkaSource(topic, bootstrap_servers=bootstrap, format="debezium"))
            .key_by("by-id", attrgetter("key_value"))
            .map_values("row", attrgetter("row"))
        )
    rows.write("topic", KafkaSink(f"{name}-out", bootstrap_servers=bootstrap))
    return p


def check_output(settings: KafkaSettings, topic: str) -> tuple[int, int, str]:
    """(records, distinct IDs, a digest of the keys and values) of an output topic."""
    records: list[TopicRecord] = read_topic(settings, topic, timeout=300)
    distinct = {r.headers.get(ids.ID_HEADER) for r in records}
    digest = hashlib.sha256()
    for key, value in sorted((r.key or b"", r.value or b"") for r in records):
        digest.update(len(key).to_bytes(4, "big") + key + len(value).to_bytes(4, "big") + value)
    return len(records), len(distinct), digest.hexdigest()


def run_once(
    spark: Any, kind: str, topic: str, changes: int, env: dict[str, Any]
) -> dict[str, Any]:
    """One exactly-once run of one pipeline over its whole topic, checked from outside."""
    name = f"cdc-{kind.replace('/', '-')}-{uuid.uuid4().hex[:6]}"
    p = build(kind, name, topic, env["bootstrap"])
    t0 = time.perf_counter()
    result = p.run(
        session=spark,
        redis_url=env["redis_url"],
        available_now=True,
        max_records_per_batch=env["batch"],
        checkpoint=os.path.join(env["workdir"], name, "ckpt"),
        output_dir=os.path.join(env["workdir"], name),
        progress=False,
    )
    seconds = time.perf_counter() - t0
    history = result.extra["history"][1:]  # the query's first micro-batch is its warm-up
    steady_n = sum(n for _, n, _ in history)
    steady_s = sum(s for _, _, s in history)
    records, distinct, digest = check_output(env["settings"], f"{name}-out")
    return {
        "kind": kind,
        "seconds": seconds,
        "rate": changes / seconds,
        "steady": steady_n / steady_s if steady_s else 0.0,
        "records_in": result.records_in,
        "dead_letters": result.dead_letters,
        "found": (records, distinct),
        "digest": digest,
    }


@dataclass
class Results:
    """What :func:`bench` measured: the captures, each pipeline's runs, input bytes/record."""

    changes: int
    captures: list[Capture]
    runs: dict[str, list[dict[str, Any]]]
    bytes_per_record: dict[str, float]

    def exact(self, kind: str) -> bool:
        """Every run of ``kind``: one record per change, each ID once, the common output."""
        digests = {r["digest"] for rs in self.runs.values() for r in rs}
        return len(digests) == 1 and all(
            r["found"] == (self.changes, self.changes) and not r["dead_letters"]
            for r in self.runs[kind]
        )


def mean_bytes(settings: KafkaSettings, topic: str) -> float:
    """Key + value bytes per change record of a topic (tombstones left out)."""
    sizes = [
        len(r.key or b"") + len(r.value)
        for r in read_topic(settings, topic, timeout=300)
        if r.value is not None
    ]
    return sum(sizes) / max(1, len(sizes))


def bench(spark: Any, args: argparse.Namespace, env: dict[str, Any]) -> Results:
    """Capture the changes, make the plain topic, and run every pipeline (see the module)."""
    settings = env["settings"]
    captures = []
    for converter in args.converters.split(","):
        c = capture(env["pg"], env["bootstrap"], converter, args.changes, args.tx_rows)
        s = c.seconds
        print(
            f"Debezium capture ({converter}): Connect started in {s['start']:.1f} s, snapshot of "
            f"{split(args.changes)[0]:,} rows in {s['snapshot']:.1f} s, "
            f"{c.changes - split(args.changes)[0]:,} changes streamed in {s['streamed']:.1f} s "
            f"(the database's writes took {s['writes']:.1f} s)",
            flush=True,
        )
        if c.changes != args.changes:
            msg = f"the statements changed {c.changes:,} rows, not {args.changes:,}"
            raise RuntimeError(msg)
        captures.append(c)
    plain_topic, plain_n = plain_copy(settings, captures[0].topic)
    assert plain_n == args.changes, (plain_n, args.changes)
    topics = {f"debezium/{c.converter}": c.topic for c in captures}
    topics[PLAIN] = plain_topic
    sizes = {kind: mean_bytes(settings, t) for kind, t in topics.items()}
    kinds = list(topics)
    if args.warmup:  # the JVM's first query, not counted
        run_once(spark, kinds[0], topics[kinds[0]], args.changes, env)
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    for round_ in range(args.repeat):
        order = kinds[round_ % len(kinds) :] + kinds[: round_ % len(kinds)]
        for kind in order:
            r = run_once(spark, kind, topics[kind], args.changes, env)
            runs[kind].append(r)
            print(
                f"round {round_ + 1} {kind:<22} {r['seconds']:6.1f} s {r['rate']:>9,.0f} rec/s "
                f"overall {r['steady']:>9,.0f} rec/s steady (out {r['found'][0]:,})",
                flush=True,
            )
    return Results(args.changes, captures, runs, sizes)


def table(results: Results) -> list[str]:
    """The Markdown table (printed too): each pipeline beside the plain one."""
    runs = results.runs

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[kind])

    def cell(kind: str, key: str) -> str:
        values = [r[key] for r in runs[kind]]
        if not all(values):  # one micro-batch: no steady state
            return "-"
        return f"{med(kind, key):,.0f} ({min(values):,.0f}–{max(values):,.0f})"

    lines = [
        f"{results.changes:,} row changes, exactly-once, {len(runs[PLAIN])} run(s) per pipeline; "
        "median (min–max)",
        "",
        "| pipeline | input bytes/record | records/s (whole run) | steady records/s | "
        "vs plain Kafka | exact |",
        "|---|---|---|---|---|---|",
    ]
    base = med(PLAIN, "rate")
    for kind in (*[k for k in runs if k != PLAIN], PLAIN):
        exact = "yes" if results.exact(kind) else f"NO {[r['found'] for r in runs[kind]]}"
        lines.append(
            f"| {kind} | {results.bytes_per_record[kind]:,.0f} | {cell(kind, 'rate')} | "
            f"{cell(kind, 'steady')} | {med(kind, 'rate') / base:.0%} | {exact} |"
        )
    return lines


def capture_lines(results: Results) -> list[str]:
    """How long Debezium took to bring the changes into Kafka (for information)."""
    snapshot = split(results.changes)[0]
    lines = []
    for c in results.captures:
        s = c.seconds
        streamed = c.changes - snapshot
        lines.append(
            f"Debezium capture ({c.converter}), not part of the records/s above: the snapshot of "
            f"{snapshot:,} rows in {s['snapshot']:.1f} s ({snapshot / s['snapshot']:,.0f}/s) "
            f"after Connect's start ({s['start']:.1f} s), then {streamed:,} changes from the "
            f"first write to the last event in Kafka in {s['streamed']:.1f} s "
            f"({streamed / s['streamed']:,.0f}/s; the database's writes took {s['writes']:.1f} s)."
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--changes", type=int, default=100_000, help="row changes made")
    ap.add_argument("--batch", type=int, default=25_000, help="records per micro-batch at most")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tx-rows", type=int, default=1000, help="rows per transaction")
    ap.add_argument("--converters", default="schemas", help=f"of {', '.join(CONVERTERS)}")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false", help=argparse.SUPPRESS)
    ap.add_argument("--markdown", help="also write the section to this file")
    args = ap.parse_args()
    unknown = set(args.converters.split(",")) - set(CONVERTERS)
    if unknown or args.changes < 10:
        ap.error(f"--converters of {', '.join(CONVERTERS)}; --changes at least 10")
    load = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        redis_url, bootstrap, _ = stack.enter_context(services(False))
        pg = LocalPostgres()
        stack.callback(pg.stop)  # registered first: a start cut short stops it too
        pg.start()
        workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="onceflow-cdc-"))
        env = {
            "redis_url": redis_url,
            "bootstrap": bootstrap,
            "settings": KafkaSettings(bootstrap),
            "pg": pg,
            "workdir": workdir,
            "batch": args.batch,
        }
        spark = spark_session(DEFAULT_MASTER, app_name="onceflow-bench-cdc")
        results = bench(spark, args, env)
        lines = table(results)
        print("\n".join(["", *lines, "", *capture_lines(results)]))
        if args.markdown:
            command = (
                f"Generated by `python bench/cdc.py --changes {args.changes} --batch {args.batch} "
                f"--repeat {args.repeat} --tx-rows {args.tx_rows} --converters {args.converters} "
                f"--markdown {args.markdown}` on {time.strftime('%Y-%m-%d')} ({os.cpu_count()} "
                f"cores, load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the "
                "end; Spark `local[2]`, one Kafka broker, Redis, PostgreSQL and Kafka Connect on "
                "the same machine). The CDC pipeline of `tests/e2e_pipelines/cdc.py` reading "
                "Debezium's topic (`format='debezium'`) beside the same pipeline reading the "
                "same changes as plain JSON records (the baseline), exactly-once into a "
                "transactional Kafka topic; *exact*: an outside reader found one record per "
                "change, each ID once, and the same output from every pipeline. See the module "
                "docstring of `bench/cdc.py`."
            )
            body = [command, "", *lines, "", *capture_lines(results)]
            page.replace_section(args.markdown, SECTION, body)
            print(f"\nwrote {args.markdown}")


if __name__ == "__main__":
    main()
