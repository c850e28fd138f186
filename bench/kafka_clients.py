"""kafka-python against confluent-kafka: raw throughput, and the exactly-once pipeline with each.

Part 1, the clients alone against one broker, ``--records`` messages of ``--value-bytes``
bytes each (two partitions), ``--repeat`` times, clients alternating, each measured two ways:

* *library*: the library's own calls, as a program using it directly would make them
  (produce: ``send``/``produce`` then ``flush``; consume: assign, then poll until every
  message arrived);
* *onceflow*: through ``connectors/kafka/clients.py``, the adapter the sink and the source's
  workers use (produce with the sink's settings, acks=all and linger 5 ms, a delivery per
  record; consume ``read_committed`` into column batches, partition by partition).

Part 2, exactly-once pipelines with ``KafkaSource(client=...)`` and ``KafkaSink(client=...)``
both set to each client, transactional sink, on the same input topic: ``count``, the keyed
count of ``bench/exactly_once.py`` (reads every record, writes ~1,000 counts a batch), and
``copy`` (reads every record and writes it again). Each run in a fresh process (a new Spark
JVM) after one unmeasured warm-up query, clients alternating, ``--repeat`` times. Prints
records/s overall and steady (without the first micro-batch), with the spread, and the
ratio of the clients.

    python bench/kafka_clients.py [--records 100000] [--batch 25000] [--repeat 2]
        [--value-bytes 100] [--shapes count,copy] [--no-pipeline]

Uses REDIS_URL / KAFKA_BOOTSTRAP_SERVERS when set, else starts a local Redis and Apache Kafka.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

from exactly_once import services  # the same Redis and Kafka set-up as bench/exactly_once.py

from onceflow import KafkaSink, KafkaSource, Pipeline
from onceflow.connectors.kafka.clients import (
    WORKER_CLIENTS,
    ensure_topics,
    new_producer,
    new_reader,
)
from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import produce
from onceflow.runtime.spark_env.session import DEFAULT_MASTER, spark_session

PARTITIONS = 2
SINK_PRODUCER = {"acks": "all", "linger_ms": 5, "batch_size": 256 * 1024}
CHILD_TIMEOUT_S = 1800
SHAPES = {
    "count": "keyed count (every record read, ~1,000 counts written per batch)",
    "copy": "copy (every record read and written again)",
}

# -- part 1: the clients alone ------------------------------------------------------------------


def produce_library(client: str, bootstrap: str, topic: str, values: list[bytes]) -> float:
    """Seconds to produce ``values`` with the library's own calls."""
    if client == "confluent":
        from confluent_kafka import Producer

        producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5,
                             "batch.size": 256 * 1024})  # fmt: skip
        started = time.perf_counter()
        for i, value in enumerate(values):
            while True:
                try:
                    producer.produce(topic, value, partition=i % PARTITIONS)
                    break
                except BufferError:
                    producer.poll(0.01)
        producer.flush(120)
        return time.perf_counter() - started
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5,
                             batch_size=256 * 1024)  # fmt: skip
    started = time.perf_counter()
    for i, value in enumerate(values):
        producer.send(topic, value, partition=i % PARTITIONS)
    producer.flush(120)
    seconds = time.perf_counter() - started
    producer.close()
    return seconds


def consume_library(client: str, bootstrap: str, topic: str, total: int) -> float:
    """Seconds to consume ``total`` messages of ``topic`` from the start with the library."""
    if client == "confluent":
        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench",
                             "enable.auto.commit": False})  # fmt: skip
        started = time.perf_counter()
        consumer.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
        seen = 0
        while seen < total:
            seen += sum(1 for m in consumer.consume(5000, 1.0) if m.error() is None)
        seconds = time.perf_counter() - started
        consumer.close()
        return seconds
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                             max_poll_records=5000)  # fmt: skip
    started = time.perf_counter()
    tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
    consumer.assign(tps)
    for tp in tps:
        consumer.seek(tp, 0)
    seen = 0
    while seen < total:
        seen += sum(len(rs) for rs in consumer.poll(timeout_ms=1000).values())
    seconds = time.perf_counter() - started
    consumer.close()
    return seconds


def produce_onceflow(
    client: str, settings: KafkaSettings, topic: str, values: list[bytes]
) -> float:
    """Seconds to produce ``values`` through Onceflow's producer adapter, checking each delivery."""
    producer = new_producer(client, settings, SINK_PRODUCER)
    headers = [("onceflow-id", b"0123456789abcdef")]
    started = time.perf_counter()
    sent = [producer.send(topic, None, value, headers, None) for value in values]
    producer.flush(120)
    failed = sum(1 for d in sent if not d.done or d.failure is not None)
    seconds = time.perf_counter() - started
    producer.close(10)
    assert not failed, f"{failed} deliveries failed"
    return seconds


def consume_onceflow(
    client: str, settings: KafkaSettings, topic: str, ends: dict[int, int]
) -> float:
    """Seconds to read ``topic`` up to ``ends``, partition by partition, through Onceflow's
    reader adapter (what the source's workers use)."""
    reader = new_reader(client, settings)
    started = time.perf_counter()
    seen = 0
    for partition, end in ends.items():
        reader.seek(topic, partition, 0)
        position = 0
        while position < end:
            fetched = reader.poll(1.0)
            if len(fetched):
                seen += len(fetched)
                position = fetched.offsets[-1] + 1
    seconds = time.perf_counter() - started
    reader.close()
    assert seen == sum(ends.values()), (seen, ends)
    return seconds


def end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap)
    tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
    ends = {tp.partition: int(end) for tp, end in consumer.end_offsets(tps).items()}
    consumer.close()
    return ends


def raw_bench(args: argparse.Namespace, bootstrap: str) -> None:
    settings = KafkaSettings(bootstrap)
    rng = random.Random(1)
    values = [rng.randbytes(args.value_bytes) for _ in range(args.records)]
    cases: dict[str, Callable[[str], float]] = {}
    rates: dict[tuple[str, str], list[float]] = {}

    def fresh_topic() -> str:
        topic = f"bench-raw-{uuid.uuid4().hex[:8]}"
        ensure_topics(settings, [topic], PARTITIONS)
        return topic

    # one topic filled beforehand, read by every consume run
    source = fresh_topic()
    produce_library("python", bootstrap, source, values)
    ends = end_offsets(bootstrap, source)
    cases["produce, library"] = lambda c: produce_library(c, bootstrap, fresh_topic(), values)
    cases["produce, onceflow"] = lambda c: produce_onceflow(c, settings, fresh_topic(), values)
    cases["consume, library"] = lambda c: consume_library(c, bootstrap, source, len(values))
    cases["consume, onceflow"] = lambda c: consume_onceflow(c, settings, source, ends)
    for i in range(args.repeat):
        for case, run in cases.items():
            for client in WORKER_CLIENTS:
                rate = len(values) / run(client)
                rates.setdefault((case, client), []).append(rate)
                print(f"  run {i + 1} {case:<18} {client:<10} {rate:>10,.0f} msg/s", flush=True)
    print()
    print(f"{args.records:,} messages of {args.value_bytes} bytes, {PARTITIONS} partitions, "
          f"median of {args.repeat} (spread)")  # fmt: skip
    print(f"{'':<20} {'kafka-python':>26} {'confluent-kafka':>26} {'ratio':>7}")
    for case in cases:
        py, cf = rates[(case, "python")], rates[(case, "confluent")]
        print(f"{case:<20} {_cell(py):>26} {_cell(cf):>26} "
              f"{statistics.median(cf) / statistics.median(py):>6.1f}x")  # fmt: skip


def _cell(rates: list[float]) -> str:
    return f"{statistics.median(rates):,.0f} ({min(rates):,.0f}..{max(rates):,.0f})"


# -- part 2: the exactly-once pipeline with each client ------------------------------------------


def build(name: str, topic: str, client: str, batch: int, shape: str) -> Pipeline:
    """``count``: a keyed count (few records out); ``copy``: every record out again."""
    p = Pipeline(name)
    events = p.read("events", KafkaSource(topic, client=client, max_records_per_batch=batch))
    if shape == "copy":
        events.write("copy", KafkaSink(f"{name}-out", client=client))
        return p
    (
        events.key_by("by-user", lambda e: e["user"])
        .count_per_key("count")
        .write("counts", KafkaSink(f"{name}-out", client=client))
    )
    return p


def run_once(spark: Any, args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    name = f"bench-{args.child[:2]}-{uuid.uuid4().hex[:6]}"
    started = time.perf_counter()
    result = build(name, args.topic, args.child, args.batch, args.shape).run(
        session=spark,
        redis_url=os.environ["REDIS_URL"],
        available_now=True,
        checkpoint=os.path.join(workdir, name, "ckpt"),
        output_dir=os.path.join(workdir, name),
        progress=False,
    )
    seconds = time.perf_counter() - started
    assert result.records_in == args.records, (result.records_in, args.records)
    history = result.extra["history"][1:]  # the first micro-batch of a query is warm-up
    steady_seconds = sum(s for _, _, s in history)
    return {
        "rate": args.records / seconds,
        "steady": sum(n for _, n, _ in history) / steady_seconds if steady_seconds else 0.0,
        "batches": result.batches,
        "seconds": seconds,
    }


def child(args: argparse.Namespace) -> None:
    """One measured run in this fresh process (after an unmeasured warm-up run)."""
    spark = spark_session(args.master, app_name="bench-kafka-clients")
    workdir = tempfile.mkdtemp(prefix="onceflow-bench-clients-")
    run_once(spark, args, workdir)
    print("RESULT " + json.dumps(run_once(spark, args, workdir)))


def spawn(
    client: str, shape: str, topic: str, args: argparse.Namespace, env: dict[str, str]
) -> Any:
    cmd = [sys.executable, __file__, "--child", client, "--shape", shape, "--topic", topic,
           "--records", str(args.records), "--batch", str(args.batch),
           "--master", args.master]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False,
                         timeout=CHILD_TIMEOUT_S)  # fmt: skip
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    msg = f"benchmark child failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    raise RuntimeError(msg)


def pipeline_bench(args: argparse.Namespace, redis_url: str, bootstrap: str) -> None:
    kafka = KafkaSettings(bootstrap)
    topic = f"bench-eo-{uuid.uuid4().hex[:6]}"
    rng = random.Random(1)
    records = (
        (None, json.dumps({"user": f"u{rng.randrange(1000)}", "n": i}).encode(), None)
        for i in range(args.records)
    )
    produce(kafka, topic, records, partitions=PARTITIONS)
    env = {**os.environ, "REDIS_URL": redis_url, "KAFKA_BOOTSTRAP_SERVERS": bootstrap}
    for shape in args.shapes.split(","):
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in WORKER_CLIENTS}
        for i in range(args.repeat):
            for client in WORKER_CLIENTS:
                r = spawn(client, shape, topic, args, env)
                runs[client].append(r)
                print(f"  run {i + 1} {shape:<6} {client:<10} {r['seconds']:6.1f} s "
                      f"{r['rate']:>8,.0f} rec/s overall {r['steady']:>8,.0f} rec/s steady "
                      f"({r['batches']} batches)", flush=True)  # fmt: skip
        report(shape, runs, args)


def report(shape: str, runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    what = SHAPES[shape]
    print()
    print(f"exactly-once {what}, {args.records:,} records, batches of {args.batch:,}, "
          f"transactional sink; median of {args.repeat} (spread)")  # fmt: skip
    print(f"{'client (source and sink)':<26} {'overall rec/s':>26} {'steady rec/s':>26}")
    for client, rs in runs.items():
        print(f"{client:<26} {_cell([r['rate'] for r in rs]):>26} "
              f"{_cell([r['steady'] for r in rs]):>26}")  # fmt: skip
    py, cf = runs["python"], runs["confluent"]
    overall = statistics.median(r["rate"] for r in cf) / statistics.median(r["rate"] for r in py)
    steady = statistics.median(r["steady"] for r in cf) / statistics.median(r["steady"] for r in py)
    print(f"{'confluent / python':<26} {overall:>25.2f}x {steady:>25.2f}x")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=25_000)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--value-bytes", type=int, default=100)
    parser.add_argument("--master", default=DEFAULT_MASTER)
    parser.add_argument("--no-pipeline", action="store_true", help="part 1 only")
    parser.add_argument("--shapes", default="count,copy", help="pipelines: count, copy")
    parser.add_argument("--shape", default="count", help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=WORKER_CLIENTS, help=argparse.SUPPRESS)
    parser.add_argument("--topic", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    with services() as (redis_url, bootstrap):
        print("part 1: the clients alone")
        raw_bench(args, bootstrap)
        if not args.no_pipeline:
            print()
            print("part 2: the exactly-once pipeline")
            pipeline_bench(args, redis_url, bootstrap)


if __name__ == "__main__":
    main()
