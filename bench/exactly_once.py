"""Exactly-once against at-least-once: one Kafka-to-Kafka keyed count, both ways, one run.

The baseline is the same pipeline with ``guarantee="at-least-once"``: keyed state in Redis,
but no record IDs, no backup and no dedup. A third mode, ``exactly-once/plain-sink``, is
exactly-once with ``KafkaSink(transactional=False)``: the cost of the transactional sink (the
default) is the difference between the last two. Both read the same topic from the start with a
fresh checkpoint and namespace, alternating, ``--repeat`` times, each in a fresh process (a new
Spark JVM: successive queries in one JVM slow down, for both modes alike) that first runs one
unmeasured warm-up query. Prints records/s (whole run, and steady state without the first
micro-batch of the query) and their ratio, micro-batch latency (p50/p99), Redis round trips
per 1,000 records, Redis lookups per 1,000 new IDs next to the Bloom filters' configured
false-positive rate, Bloom filter memory, and Redis bytes per stored ID.

    python bench/exactly_once.py [--records 200000] [--batch 50000] [--repeat 2]
        [--redis-cluster] [--spark-cluster]

Uses REDIS_URL / KAFKA_BOOTSTRAP_SERVERS when set, else starts local ones. ``--redis-cluster``
starts a local Redis Cluster (3 masters, 3 replicas) instead of one Redis and prints, per
node, keys, memory and commands served during the runs. ``--spark-cluster`` also runs every
mode on a local Spark standalone cluster of two workers (one core each), beside ``--master``
on the same machine.
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

from onceflow import DedupConfig, KafkaSink, KafkaSource, Pipeline
from onceflow.connectors.kafka.topics import produce
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.scopes import Connect, read_scopes
from onceflow.kernel.settings import KafkaSettings, RedisSettings, redis_client
from onceflow.runtime.session import spark_session
from onceflow.testing.cluster import LocalRedisCluster, LocalSparkCluster
from onceflow.testing.kafka import LocalKafka
from onceflow.testing.services import LocalRedis

# mode -> (guarantee, transactional Kafka sink)
MODES = {
    "at-least-once": ("at-least-once", False),
    "exactly-once/plain-sink": ("exactly-once", False),
    "exactly-once": ("exactly-once", True),
}


def build(name: str, topic: str, out: str, transactional: bool = True) -> Pipeline:
    p = Pipeline(name)
    (
        p.read("events", KafkaSource(topic, codec="json"))
        .key_by("by-user", lambda e: e["user"])
        .count_per_key("count")
        .write("counts", KafkaSink(out, transactional=transactional))
    )
    return p


def run_once(
    spark: Any,
    mode: str,
    topic: str,
    records: int,
    batch: int,
    redis_url: str,
    workdir: str,
    config: DedupConfig,
) -> dict[str, Any]:
    guarantee, transactional = MODES[mode]
    name = f"bench-{guarantee[:2]}-{uuid.uuid4().hex[:6]}"
    pipeline = build(name, topic, f"{name}-out", transactional)
    started = time.perf_counter()
    result = pipeline.run(
        session=spark,
        redis_url=redis_url,
        guarantee=guarantee,
        available_now=True,
        max_records_per_batch=batch,
        checkpoint=os.path.join(workdir, name, "ckpt"),
        output_dir=os.path.join(workdir, name),
        dedup=config,
        progress=False,
    )
    seconds = time.perf_counter() - started
    assert result.records_in == records, (result.records_in, records)
    history = result.extra["history"][1:]  # the first micro-batch of a query is warm-up
    steady_records = sum(n for _, n, _ in history)
    steady_seconds = sum(s for _, _, s in history)
    durations = sorted(s for _, _, s in result.extra["history"])
    return {
        "p50_s": durations[len(durations) // 2],
        "p99_s": durations[min(len(durations) - 1, int(len(durations) * 0.99))],
        "name": name,
        "seconds": seconds,
        "rate": records / seconds,
        "steady": steady_records / steady_seconds if steady_seconds else 0.0,
        "counters": result.counters,
        "batches": result.batches,
    }


def seen_keys(client: Any, namespace: str, connect: Connect) -> Iterator[tuple[Any, bytes]]:
    """``(client, key)`` of every seen-ID shard of a namespace, in its tag and its scopes."""
    for ks in read_scopes(client, Keyspace(namespace)).keyspaces():
        tagged = connect(ks.tag)
        for key in tagged.scan_iter(match=ks.seen_pattern(), count=1000):
            yield tagged, key


def redis_footprint(client: Any, namespace: str, connect: Connect) -> tuple[int, int, int]:
    """(bytes, IDs, generations) of the seen-ID shards of a namespace."""
    total_bytes = total_ids = 0
    generations = set()
    for tagged, key in seen_keys(client, namespace, connect):
        total_bytes += tagged.memory_usage(key, samples=0) or 0
        total_ids += tagged.hlen(key)
        generations.add(key.rsplit(b":", 2)[1])
    return total_bytes, total_ids, len(generations)


@contextlib.contextmanager
def services(redis_cluster: bool) -> Any:
    with contextlib.ExitStack() as stack:
        cluster = None
        if redis_cluster:
            cluster = LocalRedisCluster().start()
            stack.callback(cluster.stop)
            seeds = ",".join(f"127.0.0.1:{port}" for port in cluster.ports)
            redis_url = f"redis+cluster://{seeds}"
        else:
            redis_url = os.environ.get("REDIS_URL") or stack.enter_context(LocalRedis()).url
        bootstrap = (
            os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or stack.enter_context(LocalKafka()).bootstrap
        )
        yield redis_url, bootstrap, cluster


def node_commands(cluster: LocalRedisCluster) -> dict[int, int]:
    """Commands each running node has served so far."""
    return {
        port: int(cluster.node_client(port).info("stats")["total_commands_processed"])
        for port in cluster.running_ports()
    }


def print_nodes(
    cluster: LocalRedisCluster, before: dict[int, int], namespaces: set[str], connect: Connect
) -> None:
    """Keys, memory and commands per node: where the pipelines' state went.

    ``tags`` counts the hash tags a master serves: each namespace's own, and its partition
    scopes (the exchange stages' partitions, see onceflow.kernel.scopes).
    """
    from onceflow.kernel.slots import namespace_slot

    homes: dict[int, int] = {}
    for name in namespaces:
        for ks in read_scopes(connect(name), Keyspace(name)).keyspaces():
            port = cluster.slot_owner(namespace_slot(ks.tag)).port
            homes[port] = homes.get(port, 0) + 1
    after = node_commands(cluster)
    print()
    print(f"{'Redis node':<12} {'role':<8} {'keys':>8} {'used MB':>8} {'commands':>10}  tags")
    for stats in cluster.node_stats():
        served = after.get(stats.port, 0) - before.get(stats.port, 0)
        print(
            f"{stats.port:<12} {stats.role:<8} {stats.keys:>8,} "
            f"{stats.used_memory / 1e6:>8.1f} {served:>10,}  {homes.get(stats.port, 0)}"
        )


def child(args: argparse.Namespace) -> None:
    """One measured run in this fresh process (after an unmeasured warm-up run)."""
    spark = spark_session(args.master, app_name="bench-exactly-once")
    config = DedupConfig()
    workdir = tempfile.mkdtemp(prefix="onceflow-bench-")
    redis_url = os.environ["REDIS_URL"]
    run_once(spark, args.child, args.topic, args.records, args.batch, redis_url, workdir, config)
    result = run_once(
        spark, args.child, args.topic, args.records, args.batch, redis_url, workdir, config
    )
    print("RESULT " + json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=50_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--topic", help=argparse.SUPPRESS)
    parser.add_argument("--redis-cluster", action="store_true")
    parser.add_argument("--spark-cluster", action="store_true")
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    with contextlib.ExitStack() as stack:
        masters = [args.master]
        if args.spark_cluster:
            spark_cluster = stack.enter_context(LocalSparkCluster(workers=2, cores=1))
            masters.append(spark_cluster.master_url)
        redis_url, bootstrap, cluster = stack.enter_context(services(args.redis_cluster))
        for master in masters:
            bench_on(args, master, redis_url, bootstrap, cluster)


def bench_on(
    args: argparse.Namespace,
    master: str,
    redis_url: str,
    bootstrap: str,
    cluster: LocalRedisCluster | None,
) -> None:
    """Every mode ``--repeat`` times on one Spark master; the report."""
    args = argparse.Namespace(**{**vars(args), "master": master})
    print(f"\n=== Spark master {master}, Redis {redis_url.rsplit('@', maxsplit=1)[-1]}")
    before = node_commands(cluster) if cluster is not None else {}
    kafka = KafkaSettings.from_env(bootstrap)
    topic = f"bench-{uuid.uuid4().hex[:6]}"
    rng = random.Random(1)
    t0 = time.perf_counter()
    records = (
        (None, json.dumps({"user": f"u{rng.randrange(1000)}", "n": i}).encode(), None)
        for i in range(args.records)
    )
    produce(kafka, topic, records, partitions=2)
    print(f"produced {args.records:,} records in {time.perf_counter() - t0:.1f} s")
    env = {**os.environ, "REDIS_URL": redis_url, "KAFKA_BOOTSTRAP_SERVERS": bootstrap}
    # a local standalone cluster shares this machine's disk: checkpoints under /tmp are shared
    env["ONCEFLOW_SHARED_DIRS"] = tempfile.gettempdir()
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for i in range(args.repeat):
        for mode in MODES:
            r = spawn(mode, topic, args, env)
            runs[mode].append(r)
            print(
                f"  run {i + 1} {mode:<24} {r['seconds']:6.1f} s  "
                f"{r['rate']:>8,.0f} rec/s overall  {r['steady']:>8,.0f} rec/s steady "
                f"({r['batches']} batches, p50 {r['p50_s']:.2f} s, p99 {r['p99_s']:.2f} s)",
                flush=True,
            )
    last = runs["exactly-once"][-1]["name"]
    settings = RedisSettings(redis_url)

    def connect(tag: str) -> Any:
        return redis_client(settings, tag)

    report(runs, args.records, connect(last), connect, DedupConfig())
    if cluster is not None:
        print_nodes(cluster, before, {r["name"] for rs in runs.values() for r in rs}, connect)


def child_command(guarantee: str, topic: str, args: argparse.Namespace) -> list[str]:
    """The command of one measured run in a fresh process (``bench/profile_workers.py`` too)."""
    return [
        sys.executable,
        __file__,
        "--child",
        guarantee,
        "--topic",
        topic,
        "--records",
        str(args.records),
        "--batch",
        str(args.batch),
        "--master",
        args.master,
    ]


def spawn(guarantee: str, topic: str, args: argparse.Namespace, env: dict[str, str]) -> Any:
    """Run one measured query in a fresh process; return its result."""
    cmd = child_command(guarantee, topic, args)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=900)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    msg = f"benchmark child failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    raise RuntimeError(msg)


def report(
    runs: dict[str, list[dict[str, Any]]],
    records: int,
    client: Any,
    connect: Connect,
    config: DedupConfig,
) -> None:
    med = {
        g: (statistics.median(r["rate"] for r in rs), statistics.median(r["steady"] for r in rs))
        for g, rs in runs.items()
    }
    alo, eo, plain = med["at-least-once"], med["exactly-once"], med["exactly-once/plain-sink"]
    print()
    print(
        f"{'median of ' + str(len(runs['exactly-once'])) + ' runs':<34} {'overall rec/s':>14} "
        f"{'steady rec/s':>14} {'spread (overall)':>22} {'batch p50/p99 s':>16}"
    )
    for g, (overall, steady) in med.items():
        rates = [r["rate"] for r in runs[g]]
        p50 = statistics.median(r["p50_s"] for r in runs[g])
        p99 = max(r["p99_s"] for r in runs[g])
        print(
            f"{g:<34} {overall:>14,.0f} {steady:>14,.0f} "
            f"{min(rates):>10,.0f}..{max(rates):<10,.0f} {p50:>7.2f}/{p99:<7.2f}"
        )
    print(f"{'exactly-once / at-least-once':<34} {eo[0] / alo[0]:>13.0%} {eo[1] / alo[1]:>13.0%}")
    print(f"{'transactional / plain sink':<34} {eo[0] / plain[0]:>13.0%} {eo[1] / plain[1]:>13.0%}")
    last = runs["exactly-once"][-1]
    c = last["counters"]
    trips = sum(v for k, v in c.items() if k.endswith("/redis_round_trips"))
    base_trips = sum(
        v
        for k, v in runs["at-least-once"][-1]["counters"].items()
        if k.endswith("/redis_round_trips")
    )
    lookups = sum(v for k, v in c.items() if k.endswith("/redis_lookups"))
    maybes = sum(v for k, v in c.items() if k.endswith("/bloom_maybe"))
    new_ids = records + sum(v for k, v in c.items() if k.startswith("count/") and k.endswith("/in"))
    new_ids += sum(v for k, v in c.items() if k.endswith("/out/counts"))
    seen_bytes, seen_ids, generations = redis_footprint(client, last["name"], connect)
    filter_bytes = int(
        -config.bloom_capacity
        * __import__("math").log(config.bloom_error)
        / (__import__("math").log(2) ** 2)
        / 8
    )
    print()
    print(
        f"Redis round trips per 1,000 records: exactly-once {1000 * trips / records:.1f}, "
        f"at-least-once {1000 * base_trips / records:.1f}"
    )
    print(
        f"Redis lookups per 1,000 new IDs: {1000 * lookups / new_ids:.2f} "
        f"(Bloom 'maybe' answers {1000 * maybes / new_ids:.2f}; configured false-positive "
        f"rate {config.bloom_error} = {1000 * config.bloom_error:.1f} per 1,000)"
    )
    print(
        f"Bloom filters: {generations} generation(s) per partition set, "
        f"{filter_bytes / 1024:,.0f} KiB each at capacity {config.bloom_capacity:,} "
        f"({filter_bytes / config.bloom_capacity:.2f} B/ID)"
    )
    if seen_ids:
        print(
            f"Redis seen-ID store: {seen_ids:,} IDs in {seen_bytes / 1e6:.1f} MB = "
            f"{seen_bytes / seen_ids:.1f} bytes per stored ID ({config.shards} shards/bucket)"
        )


if __name__ == "__main__":
    main()
