"""The programs ``bench/peers.py`` measures: one workload on one system, run until killed.

Each is what a user of that system would write for the workload, with the system's own
defaults where the workload does not force a choice:

* ``onceflow``: a :class:`~onceflow.Pipeline` run as a streaming query (trigger as fast as
  possible, ``--batch`` records per micro-batch at most), exactly-once with record IDs from
  the event's ``event_id`` (``id=``, every ID through the dedup) or at least once, with
  kafka-python (the default client) or confluent-kafka (``client="confluent"``);
* ``quix``: Quix Streams, one ``Application`` with ``processing_guarantee`` exactly-once
  (Kafka transactions) or at-least-once, a stateful ``apply`` (RocksDB state with its
  changelog topic) for the running sum;
* ``spark``: Spark Structured Streaming's own operators: the Kafka source and sink of
  ``spark-sql-kafka-0-10`` (the 4.2.0 jar from Maven Central on PySpark 4.3),
  ``from_json``, ``groupBy().agg(sum)`` in update mode, optionally
  ``withWatermark().dropDuplicatesWithinWatermark(["event_id"])`` before it. Spark's Kafka
  sink is not transactional: its output is at least once;
* ``flink``: Apache Flink SQL through PyFlink's Table API (``bench/flink_peer.py``; run with
  the Python of PyFlink's own env), Kafka sinks written with transactions committed by
  exactly-once checkpoints every ``--checkpoint-ms``.

Workloads: ``sum`` (running total of ``amount`` per user, emitted as ``{"user", "total"}``
keyed by user), ``copy`` (a filter, ``amount % 10 != 0``, and a map adding ``cents``) and
``window`` (events per user in sliding windows of 10 s every 2 s of the event's ``ts``, out of
order by 1 s at most, each window's final count emitted as ``{"user", "start", "count"}``).

    python bench/peer_jobs.py SYSTEM WORKLOAD --bootstrap B --input T --output T2 --work DIR
        [--guarantee exactly-once|at-least-once] [--client python|confluent] [--dedup]
        [--redis-url URL] [--batch 50000] [--checkpoint-ms 500] [--explain]
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from typing import Any

SYSTEMS = ("onceflow", "quix", "spark", "flink")
WORKLOADS = ("sum", "copy", "window")
WINDOW_MS, STEP_MS, LATENESS_MS = 10_000, 2_000, 1_000  # sliding 10 s every 2 s, 1 s late


def keep(e: dict[str, Any]) -> bool:
    """The stateless copy's filter (drops one event in ten)."""
    return bool(e["amount"] % 10 != 0)


def cents(e: dict[str, Any]) -> dict[str, Any]:
    """The stateless copy's map."""
    return {**e, "cents": e["amount"] * 100}


def run_onceflow(args: argparse.Namespace) -> None:
    from onceflow import EventTime, KafkaSink, KafkaSource, Pipeline, Sliding

    eo = args.guarantee == "exactly-once"
    name = f"peer-{args.workload}-{uuid.uuid4().hex[:6]}"
    timed = args.workload == "window"  # event time only where the workload needs it
    lateness = EventTime.of(out_of_orderness=f"{LATENESS_MS}ms") if timed else None
    p = Pipeline(name, event_time=lateness)
    ids: dict[str, Any] = {"id": lambda e: e["event_id"]} if eo else {}
    if timed:
        ids["timestamp"] = lambda e: e["ts"]
    source = KafkaSource(args.input, codec="json", client=args.client, **ids)
    events = p.read("events", source)
    sink = KafkaSink(
        args.output,
        key=lambda r: r["user"],
        transactional=eo,
        client=args.client,
        partitions=4,
    )
    if args.workload == "sum":
        (
            events.key_by("by-user", lambda e: e["user"])
            .map_values("amount", lambda e: e["amount"])
            .combine_per_key("total", "sum")
            .map("as-record", lambda kv: {"user": kv[0], "total": kv[1]})
            .write("totals", sink)
        )
    elif args.workload == "window":
        (
            events.key_by("by-user", lambda e: e["user"])
            .window("sliding", Sliding(f"{WINDOW_MS}ms", f"{STEP_MS}ms"))
            .count_per_key("count")
            .map(
                "as-record", lambda kv: {"user": kv[0], "start": kv[1].start, "count": kv[1].value}
            )
            .write("counts", sink)
        )
    else:
        events.filter("keep", keep).map("cents", cents).write("copies", sink)
    p.run(
        redis_url=args.redis_url,
        guarantee=args.guarantee,
        checkpoint=os.path.join(args.work, "checkpoint"),
        output_dir=args.work,
        max_records_per_batch=args.batch,
        trigger_seconds=0,
        progress=False,
        log_level="info",  # the driver's per-batch phases, read by bench/peers.py
    )


def run_quix(args: argparse.Namespace) -> None:
    from quixstreams import Application

    app = Application(
        broker_address=args.bootstrap,
        consumer_group=f"peer-quix-{uuid.uuid4().hex[:8]}",
        auto_offset_reset="earliest",
        processing_guarantee=args.guarantee,
        state_dir=os.path.join(args.work, "state"),
        loglevel="WARNING",
    )
    timed = args.workload == "window"  # event time only where the workload needs it
    extract = {"timestamp_extractor": lambda v, _h, _t, _k: v["ts"]} if timed else {}
    source = app.topic(args.input, value_deserializer="json", **extract)
    sink = app.topic(args.output, value_serializer="json")
    sdf = app.dataframe(source)
    if args.workload == "sum":

        def add(e: dict[str, Any], state: Any) -> dict[str, Any]:
            total = state.get("total", 0) + e["amount"]
            state.set("total", total)
            return {"user": e["user"], "total": total}

        sdf = sdf.apply(add, stateful=True)
    elif args.workload == "window":
        windows = sdf.hopping_window(WINDOW_MS, STEP_MS, grace_ms=LATENESS_MS).count().final()

        def record(w: dict[str, Any], key: Any, _ts: int, _headers: Any) -> dict[str, Any]:
            user = key.decode() if isinstance(key, bytes) else key
            return {"user": user, "start": w["start"], "count": w["value"]}

        sdf = windows.apply(record, metadata=True)
    else:
        sdf = sdf.filter(keep).apply(cents)
    sdf.to_topic(sink)
    app.run()


def run_spark(args: argparse.Namespace) -> None:
    from pyspark.sql import functions as F

    from onceflow.connectors.kafka.spark_jars import JARS_CONF, connector_jars
    from onceflow.runtime.spark_env.session import DEFAULT_MASTER, spark_session

    jars = {JARS_CONF: ",".join(connector_jars())}
    spark = spark_session(DEFAULT_MASTER, app_name="peer-spark", extra_conf=jars)
    raw = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", args.bootstrap)
        .option("subscribe", args.input)
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", str(args.batch))
        .load()
    )
    schema = "user STRING, amount LONG, event_id STRING, ts LONG, sent_ms LONG"
    events = raw.select(F.from_json(F.col("value").cast("string"), schema).alias("e")).select("e.*")
    if args.dedup:
        events = (
            events.withColumn("event_time", F.timestamp_millis("ts"))
            .withWatermark("event_time", "10 seconds")
            .dropDuplicatesWithinWatermark(["event_id"])
        )
    if args.workload == "sum":
        totals = events.groupBy("user").agg(F.sum("amount").alias("total"))
        out = totals.select(
            F.col("user").alias("key"), F.to_json(F.struct("user", "total")).alias("value")
        )
        mode = "update"
    elif args.workload == "window":
        if not args.dedup:
            events = events.withColumn("event_time", F.timestamp_millis("ts")).withWatermark(
                "event_time", f"{LATENESS_MS} milliseconds"
            )
        counts = events.groupBy(
            F.window("event_time", f"{WINDOW_MS} milliseconds", f"{STEP_MS} milliseconds"),
            "user",
        ).count()
        record = F.struct("user", F.unix_millis("window.start").alias("start"), F.col("count"))
        out = counts.select(F.col("user").alias("key"), F.to_json(record).alias("value"))
        mode = "append"
    else:
        kept = events.where(F.col("amount") % 10 != 0).withColumn("cents", F.col("amount") * 100)
        cols = ("user", "amount", "event_id", "ts", "sent_ms", "cents")
        out = kept.select(F.col("user").alias("key"), F.to_json(F.struct(*cols)).alias("value"))
        mode = "append"
    query = (
        out.writeStream.format("kafka")
        .option("kafka.bootstrap.servers", args.bootstrap)
        .option("topic", args.output)
        .option("checkpointLocation", os.path.join(args.work, "checkpoint"))
        .outputMode(mode)
        .start()
    )
    print("peer: query started", flush=True)
    query.awaitTermination()


def run_flink(args: argparse.Namespace) -> None:
    import flink_peer  # the Flink SQL job, in PyFlink's own env (bench/flink_peer.py)

    flink_peer.run(args)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("system", choices=SYSTEMS)
    ap.add_argument("workload", choices=WORKLOADS)
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--guarantee", default="exactly-once")
    ap.add_argument("--client", default="python")
    ap.add_argument("--dedup", action="store_true")
    ap.add_argument("--redis-url")
    ap.add_argument("--batch", type=int, default=50_000)
    ap.add_argument("--checkpoint-ms", type=int, help="flink: checkpoint interval")
    ap.add_argument("--explain", action="store_true", help="flink: print the plan, run nothing")
    args = ap.parse_args(argv)
    os.environ["KAFKA_BOOTSTRAP_SERVERS"] = args.bootstrap
    runners = {"onceflow": run_onceflow, "quix": run_quix, "spark": run_spark, "flink": run_flink}
    runners[args.system](args)


if __name__ == "__main__":
    sys.exit(main())
