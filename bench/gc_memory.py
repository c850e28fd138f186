"""Redis memory over many micro-batches, with and without ``onceflow gc``, side by side.

One Kafka-to-Kafka exactly-once pipeline (copy sink + keyed count) reads a topic whose event
time advances steadily (``--minutes-per-batch`` of event time per micro-batch), with a dedup
horizon of ``--horizon``. It runs twice over the same topic, each time against its own fresh
Redis: once with a GC pass after every micro-batch (in a thread, as ``onceflow gc --every``
would run beside the job), once without. Prints Redis ``used_memory_dataset`` (the data,
without allocator and buffer overhead) after each batch for both, and the key counts at the
end: with GC the seen-ID buckets and backups stop growing once
the horizon is covered; without GC they grow with every batch.

    python bench/gc_memory.py [--batches 40] [--batch 2000] [--horizon 10m]

Uses KAFKA_BOOTSTRAP_SERVERS when set, else starts a local broker; always starts its own Redis
servers (used_memory must not include anything else).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import tempfile
import threading
import time
import uuid
from typing import Any

from onceflow import DedupConfig, KafkaSink, KafkaSource, Pipeline
from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import produce
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.scopes import read_scopes
from onceflow.operations.gc import collect
from onceflow.runtime.spark_env.session import DEFAULT_MASTER, spark_session
from onceflow.testing.kafka import LocalKafka
from onceflow.testing.services import LocalRedis

BASE_TS = 1_790_000_000_000


def build(name: str, topic: str, config: DedupConfig) -> Pipeline:
    p = Pipeline(name, dedup=config)
    events = p.read("events", KafkaSource(topic, id=lambda e: e["id"], timestamp=lambda e: e["ts"]))
    events.write("copy", KafkaSink(f"{name}-copy"))
    (
        events.key_by("by-user", lambda e: e["user"])
        .count_per_key("count")
        .write("counts", KafkaSink(f"{name}-counts"))
    )
    return p


class Sampler:
    """After every acknowledged batch: used_memory and key counts; optionally a GC pass."""

    def __init__(self, client: Any, namespace: str, gc: bool) -> None:
        self.client, self.ks, self.gc = client, Keyspace(namespace), gc
        self.samples: dict[int, tuple[int, int]] = {}
        self.removed = 0
        self.passes = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        last = -1
        while not self.stop.is_set():
            acked = int(self.client.get(self.ks.acked) or -1)
            if acked > last:
                if self.gc:
                    result = collect(self.client, self.ks.namespace)
                    self.removed += result.total.keys
                    self.passes += 1
                info = self.client.info("memory")
                self.samples[acked] = (int(info["used_memory_dataset"]), int(self.client.dbsize()))
                last = acked
            self.stop.wait(0.05)

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)


def run_mode(
    spark: Any, gc: bool, topic: str, bootstrap: str, args: argparse.Namespace, workdir: str
) -> Sampler:
    config = DedupConfig.of(horizon=args.horizon, bucket=args.bucket, shards=args.shards)
    name = f"gcbench-{'gc' if gc else 'nogc'}-{uuid.uuid4().hex[:6]}"
    with LocalRedis() as redis:
        import redis as redis_py

        client = redis_py.Redis.from_url(redis.url)
        client.config_set("activedefrag", "no")
        pipeline = build(name, topic, config)
        with Sampler(client, name, gc) as sampler:
            started = time.perf_counter()
            result = pipeline.run(
                session=spark,
                redis_url=redis.url,
                available_now=True,
                max_records_per_batch=args.batch,
                checkpoint=os.path.join(workdir, name, "ckpt"),
                output_dir=os.path.join(workdir, name),
                progress=False,
            )
            # the last batch is acknowledged at the end of the run
            deadline = time.monotonic() + 10
            while result.batches - 1 not in sampler.samples and time.monotonic() < deadline:
                time.sleep(0.05)
        seconds = time.perf_counter() - started
        kinds: dict[str, int] = {}
        for tag in read_scopes(client, Keyspace(name)).keyspaces():
            for key in client.scan_iter(match=tag.pattern(), count=1000):
                kind = key.decode()[len(tag.root) + 1 :].split(":")[0]
                kinds[kind] = kinds.get(kind, 0) + 1
        print(
            f"  {'with' if gc else 'without'} GC: {result.records_in:,} records in "
            f"{result.batches} batches, {seconds:.0f} s; keys by kind at the end: "
            f"{json.dumps(dict(sorted(kinds.items())))}"
            + (f"; {sampler.passes} GC passes removed {sampler.removed:,} keys" if gc else ""),
            flush=True,
        )
    return sampler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--batch", type=int, default=2000, help="records per micro-batch")
    ap.add_argument("--horizon", default="10m")
    ap.add_argument("--bucket", default="1m")
    ap.add_argument("--minutes-per-batch", type=float, default=2.0)
    ap.add_argument("--shards", type=int, default=64, help="seen-ID shards per bucket")
    args = ap.parse_args()
    total = args.batches * args.batch
    step_ms = int(args.minutes_per_batch * 60_000 / args.batch)
    rng = random.Random(5)
    with contextlib.ExitStack() as stack:
        bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
        if not bootstrap:
            bootstrap = stack.enter_context(LocalKafka()).bootstrap
        workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="onceflow-gcbench-"))
        topic = f"gcbench-{uuid.uuid4().hex[:6]}"
        print(
            f"producing {total:,} events: {args.batches} batches of {args.batch:,}, event time "
            f"+{args.minutes_per_batch:g} min per batch, dedup horizon {args.horizon}, buckets "
            f"of {args.bucket}",
            flush=True,
        )
        produce(
            KafkaSettings(bootstrap),
            topic,
            (
                (
                    None,
                    json.dumps(
                        {
                            "id": uuid.UUID(int=rng.getrandbits(128)).hex,
                            "user": f"u{rng.randrange(500)}",
                            "ts": BASE_TS + i * step_ms,
                            "pad": "x" * 60,
                        }
                    ).encode(),
                    None,
                )
                for i in range(total)
            ),
            partitions=2,
        )
        os.environ["KAFKA_BOOTSTRAP_SERVERS"] = bootstrap  # read by the Spark workers
        spark = spark_session(DEFAULT_MASTER, app_name="gc-bench", parallelism=2)
        without = run_mode(spark, False, topic, bootstrap, args, workdir)
        with_gc = run_mode(spark, True, topic, bootstrap, args, workdir)
    print()
    print("Redis used_memory_dataset after each micro-batch (MiB) and keys in the database")
    print(f"{'batch':>6} {'without GC':>12} {'keys':>8} {'with GC':>12} {'keys':>8}")
    batches = sorted(set(without.samples) | set(with_gc.samples))
    for b in batches:
        a = without.samples.get(b)
        g = with_gc.samples.get(b)
        print(
            f"{b:>6} "
            + (f"{a[0] / 2**20:>12.2f} {a[1]:>8,}" if a else f"{'-':>12} {'-':>8}")
            + " "
            + (f"{g[0] / 2**20:>12.2f} {g[1]:>8,}" if g else f"{'-':>12} {'-':>8}")
        )
    half = batches[len(batches) // 2] if batches else 0
    last = batches[-1] if batches else 0
    for label, s in (("without GC", without), ("with GC", with_gc)):
        if half in s.samples and last in s.samples:
            grow = (s.samples[last][0] - s.samples[half][0]) / 2**20
            print(
                f"{label}: dataset memory changed {grow:+.2f} MiB over the second half of the run"
            )


if __name__ == "__main__":
    main()
