"""Onceflow's Python Kafka source against Spark's own Kafka connector (``client="spark"``).

Produces ``--records`` JSON events (``{"id", "user"}``; every ``--header-every``-th carries a
header) to one topic of ``--partitions`` partitions (2), then reads them with each client
into the same trivial pipeline, ``read -> key_by(user) -> count_per_key -> KafkaSink``, with
``--available-now``, each run in a fresh process (a new Spark JVM; the session gets the
connector's jars only for the Spark client) with a fresh checkpoint and Redis namespace,
``--repeat`` times, clients alternating. Prints records/s overall (the query from start to
stop, session start left out) and steady state (without the first micro-batch, which warms
up the JVM and Python workers), min / median / max of each, side by side.

Then checks with each client, in fresh processes: headers arrive (an ``envelope`` pipeline
counts tagged records), ``availableNow`` stops by itself, and a restart resumes from the
checkpoint's offsets (after more records are produced, the second run reads exactly those).

    python bench/kafka_sources.py [--records 200000] [--repeat 3] [--batch 50000]
        [--guarantee exactly-once,at-least-once] [--clients python,spark] [--partitions 2]
        [--no-checks]

Uses REDIS_URL / KAFKA_BOOTSTRAP_SERVERS when set, else starts a local Redis and Apache Kafka.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import Any

from onceflow import KafkaSink, KafkaSource, Pipeline
from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.spark_source import session_conf
from onceflow.connectors.kafka.topics import produce, read_topic
from onceflow.runtime.spark_env.session import DEFAULT_MASTER, spark_session
from onceflow.testing.kafka import LocalKafka
from onceflow.testing.services import LocalRedis

CLIENTS = ("python", "spark")
GUARANTEES = ("exactly-once", "at-least-once")
USERS = 1000
PARTITIONS = 2
TAG_HEADER = "bench-tag"
CHECK_RECORDS = 20_000
CHECK_MORE = 5_000
CHECK_BATCH = 5_000
CHILD_TIMEOUT_S = 1800


def source(client: str, topic: str, batch: int, envelope: bool = False) -> KafkaSource:
    return KafkaSource(topic, codec="json", client=client, max_records_per_batch=batch,
                       envelope=envelope)  # fmt: skip


def bench_pipeline(name: str, client: str, topic: str, batch: int) -> Pipeline:
    p = Pipeline(name)
    (
        p.read("events", source(client, topic, batch))
        .key_by("by-user", lambda e: e["user"])
        .count_per_key("count")
        .write("counts", KafkaSink(f"{name}-out"))
    )
    return p


def tagged(envelope: dict[str, Any]) -> str:
    return "tagged" if TAG_HEADER in envelope["headers"] else "plain"


def check_pipeline(name: str, client: str, topic: str, out: str) -> Pipeline:
    p = Pipeline(name)
    (
        p.read("events", source(client, topic, CHECK_BATCH, envelope=True))
        .key_by("by-tag", tagged)
        .count_per_key("count")
        .write("counts", KafkaSink(out))
    )
    return p


def events(first: int, count: int, header_every: int, seed: int) -> Iterator[Any]:
    rng = random.Random(seed)
    for i in range(first, first + count):
        value = json.dumps({"id": i, "user": f"u{rng.randrange(USERS)}"}).encode()
        headers = [(TAG_HEADER, str(i).encode())] if i % header_every == 0 else None
        yield None, value, headers


# -- children: one run each, in a fresh process -------------------------------------------------


def session_for(client: str, master: str, app: str) -> tuple[Any, float]:
    """A session with the connector's jars when the client needs them; seconds to start it."""
    started = time.perf_counter()
    conf = session_conf(
        [source(client, "-", 1)]
    )  # what runtime/spark_env/session.py should do itself
    spark = spark_session(master, app_name=app, extra_conf=conf)
    return spark, time.perf_counter() - started


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    spark, session_s = session_for(args.child, args.master, "bench-kafka-sources")
    workdir = tempfile.mkdtemp(prefix="onceflow-bench-sources-")
    name = f"bench-{args.child[:2]}-{uuid.uuid4().hex[:6]}"
    started = time.perf_counter()
    result = bench_pipeline(name, args.child, args.topic, args.batch).run(
        session=spark,
        redis_url=os.environ["REDIS_URL"],
        guarantee=args.guarantee,
        available_now=True,
        checkpoint=os.path.join(workdir, "ckpt"),
        output_dir=workdir,
        progress=False,
    )
    seconds = time.perf_counter() - started
    if result.records_in != args.records or result.dead_letters:
        found = f"read {result.records_in} (expected {args.records}), {result.dead_letters} dead"
        msg = f"{name}: {found}"
        raise RuntimeError(msg)
    history = result.extra["history"]
    steady = history[1:]
    steady_n = sum(n for _, n, _ in steady)
    steady_s = sum(s for _, _, s in steady)
    return {
        "session_s": session_s,
        "seconds": seconds,
        "rate": args.records / seconds,
        "steady": steady_n / steady_s if steady_s else 0.0,
        "first_batch_s": history[0][2] if history else 0.0,
        # query start, planning every batch (offsets) and stop: the run outside foreachBatch
        "outside_s": seconds - sum(s for _, _, s in history),
        "batches": result.batches,
    }


def run_check(args: argparse.Namespace) -> dict[str, Any]:
    spark, _ = session_for(args.child, args.master, "bench-kafka-sources-check")
    timeout = CHILD_TIMEOUT_S / 3
    started = time.perf_counter()
    result = check_pipeline(args.name, args.child, args.topic, args.out).run(
        session=spark,
        redis_url=os.environ["REDIS_URL"],
        available_now=True,
        checkpoint=os.path.join(args.workdir, "ckpt"),
        output_dir=args.workdir,
        progress=False,
        timeout_seconds=timeout,
    )
    seconds = time.perf_counter() - started
    return {
        "records_in": result.records_in,
        "dead_letters": result.dead_letters,
        "seconds": seconds,
        "stopped_by_itself": seconds < timeout,  # else the timeout stopped the query
    }


# -- the parent -------------------------------------------------------------------------------


@contextlib.contextmanager
def services() -> Iterator[tuple[str, str]]:
    with contextlib.ExitStack() as stack:
        redis_url = os.environ.get("REDIS_URL") or stack.enter_context(LocalRedis()).url
        bootstrap = (
            os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or stack.enter_context(LocalKafka()).bootstrap
        )
        yield redis_url, bootstrap


def spawn(args: argparse.Namespace, env: dict[str, str], *extra: str) -> dict[str, Any]:
    """Run one child (this script with ``extra`` arguments) in a fresh process."""
    cmd = [sys.executable, __file__, "--master", args.master, "--records", str(args.records),
           "--batch", str(args.batch), *extra]  # fmt: skip
    out = subprocess.run(
        cmd, env=env, capture_output=True, text=True, check=False, timeout=CHILD_TIMEOUT_S
    )
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    msg = f"child {extra} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    raise RuntimeError(msg)


def spread(values: list[float]) -> str:
    return f"{min(values):>8,.0f} {statistics.median(values):>8,.0f} {max(values):>8,.0f}"


def report(runs: dict[tuple[str, str], list[dict[str, Any]]], records: int) -> None:
    print()
    print(f"{records:,} records, records/s (min / median / max of each)")
    head = (
        f"{'guarantee':<14} {'client':<7} {'overall min/med/max':>27}   {'steady min/med/max':>26}"
    )
    print(head + f"   {'1st batch s':>11} {'outside s':>9} {'session s':>9} {'batches':>7}")
    for (guarantee, client), rs in runs.items():
        print(
            f"{guarantee:<14} {client:<7} {spread([r['rate'] for r in rs])}   "
            f"{spread([r['steady'] for r in rs])}   "
            f"{statistics.median(r['first_batch_s'] for r in rs):>11.1f} "
            f"{statistics.median(r['outside_s'] for r in rs):>9.1f} "
            f"{statistics.median(r['session_s'] for r in rs):>9.1f} "
            f"{statistics.median(r['batches'] for r in rs):>7.0f}"
        )
    for guarantee in {g for g, _ in runs}:
        py, sp = runs.get((guarantee, "python")), runs.get((guarantee, "spark"))
        if py and sp:
            overall = statistics.median(r["rate"] for r in sp) / statistics.median(
                r["rate"] for r in py
            )
            steady = statistics.median(r["steady"] for r in sp) / statistics.median(
                r["steady"] for r in py
            )
            print(f"{guarantee}: spark / python = {overall:.2f} overall, {steady:.2f} steady")


def final_counts(kafka: KafkaSettings, topic: str) -> dict[str, int]:
    """The last count per key in a keyed-count output topic."""
    last: dict[str, tuple[int, int]] = {}
    for r in read_topic(kafka, topic):
        key = (r.key or b"").decode()  # the sink writes string keys as UTF-8
        if key not in last or r.offset > last[key][0]:
            last[key] = (r.offset, json.loads(r.value or b"0"))
    return {k: v for k, (_, v) in last.items()}


def checks(
    args: argparse.Namespace, client: str, kafka: KafkaSettings, env: dict[str, str]
) -> dict[str, Any]:
    """Headers arrive, availableNow stops, a restart resumes from the checkpoint's offsets."""
    topic = f"check-{client}-{uuid.uuid4().hex[:6]}"
    out = f"{topic}-out"
    produce(kafka, topic, events(0, CHECK_RECORDS, args.header_every, 2), partitions=PARTITIONS)
    workdir = tempfile.mkdtemp(prefix="onceflow-check-")
    child = ["--check", client, "--topic", topic, "--out", out, "--workdir", workdir,
             "--name", f"check-{client[:2]}-{uuid.uuid4().hex[:6]}"]  # fmt: skip
    first = spawn(args, env, *child)
    produce(
        kafka, topic, events(CHECK_RECORDS, CHECK_MORE, args.header_every, 3), partitions=PARTITIONS
    )
    second = spawn(args, env, *child)
    total = CHECK_RECORDS + CHECK_MORE
    tagged_expected = sum(1 for i in range(total) if i % args.header_every == 0)
    counts = final_counts(kafka, out)
    return {
        "first run read": f"{first['records_in']:,} of {CHECK_RECORDS:,}",
        "restart read (new only)": f"{second['records_in']:,} of {CHECK_MORE:,}",
        "headers arrived": f"{counts.get('tagged', 0):,} of {tagged_expected:,}",
        "counted in total": f"{sum(counts.values()):,} of {total:,}",
        "availableNow stopped": f"yes ({first['seconds']:.0f} s, {second['seconds']:.0f} s)"
        if first["stopped_by_itself"] and second["stopped_by_itself"]
        else "NO",
        "dead letters": first["dead_letters"] + second["dead_letters"],
        "ok": first["records_in"] == CHECK_RECORDS
        and second["records_in"] == CHECK_MORE
        and counts.get("tagged") == tagged_expected
        and sum(counts.values()) == total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--batch", type=int, default=50_000, help="max records per micro-batch")
    parser.add_argument("--guarantee", default=",".join(GUARANTEES))
    parser.add_argument("--clients", default=",".join(CLIENTS))
    parser.add_argument("--header-every", type=int, default=10)
    parser.add_argument("--partitions", type=int, default=PARTITIONS, help="of the bench topic")
    parser.add_argument("--master", default=DEFAULT_MASTER)
    parser.add_argument("--no-checks", action="store_true")
    for hidden in ("--child", "--check", "--topic", "--out", "--workdir", "--name"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_bench(args)))
        return
    if args.check:
        args.child = args.check
        print("RESULT " + json.dumps(run_check(args)))
        return
    clients = args.clients.split(",")
    guarantees = args.guarantee.split(",")
    with services() as (redis_url, bootstrap):
        kafka = KafkaSettings.from_env(bootstrap)
        env = {**os.environ, "REDIS_URL": redis_url, "KAFKA_BOOTSTRAP_SERVERS": bootstrap}
        topic = f"bench-sources-{uuid.uuid4().hex[:6]}"
        t0 = time.perf_counter()
        records = events(0, args.records, args.header_every, 1)
        produce(kafka, topic, records, partitions=args.partitions)
        print(
            f"produced {args.records:,} records to {args.partitions} partition(s) in "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {
            (g, c): [] for g in guarantees for c in clients
        }
        for i in range(args.repeat):
            for guarantee in guarantees:
                for client in clients:
                    r = spawn(args, env, "--child", client, "--topic", topic,
                              "--guarantee", guarantee)  # fmt: skip
                    runs[(guarantee, client)].append(r)
                    print(
                        f"  run {i + 1} {guarantee:<14} {client:<7} {r['seconds']:6.1f} s "
                        f"{r['rate']:>8,.0f} rec/s overall {r['steady']:>8,.0f} rec/s steady "
                        f"(first batch {r['first_batch_s']:.1f} s, outside batches "
                        f"{r['outside_s']:.1f} s, {r['batches']} batches)",
                        flush=True,
                    )
        report(runs, args.records)
        if args.no_checks:
            return
        print()
        for client in clients:
            found = checks(args, client, kafka, env)
            print(f"checks, client={client}: " + "; ".join(f"{k}: {v}" for k, v in found.items()))


if __name__ == "__main__":
    main()
