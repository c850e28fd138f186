"""How evenly a pipeline's Redis memory and commands spread over a Redis Cluster's masters.

Starts a local Redis Cluster (3 masters, 3 replicas, ``onceflow.testing.LocalRedisCluster``)
and a local Kafka broker, writes ``--records`` bids with an ID of their own (``n``) on
``--partitions`` partitions, and runs two exactly-once pipelines on them, one after the
other, each in a fresh namespace, with ``--parallelism``:

* ``stateless``: ``map`` -> ``filter`` -> Kafka sink (Nexmark q1/q2 shape, IDs from ``n``):
  its dedup is the source stage's seen-IDs;
* ``keyed``: ``key_by(user) -> count_per_key`` -> Kafka sink (IDs from ``n``): the keyed
  stage's partitions keep their state in partition scopes (``onceflow.kernel.scopes``).

For each, per master: the pipeline's keys and their memory (``MEMORY USAGE`` of every key of
the namespace and its scopes, by kind: seen-IDs, backups, Bloom filter snapshot and journal,
keyed state, the rest), the commands it served during the run (``INFO commandstats``, the
commands scripts run included, and the script calls), the CPU of its main thread (``INFO
cpu``), its network bytes in and out, and the change of ``used_memory``; the same after an
``onceflow gc`` pass; then the *spread*: the largest
distance of a master from the masters' mean, over that mean (0 % is perfectly even; "within
20 %" is every master within 20 % of the mean).

A source stage's seen-IDs share the namespace's hash tag with its commits, so they sit on
one master: ``docs/concepts/dedup.md`` ("One layout") has what spreading them over the
masters measured, and why it was not kept.

    python bench/cluster_balance.py [--records 100000] [--batch 25000] [--partitions 4]
        [--parallelism 6] [--workloads stateless,keyed]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from onceflow import DedupConfig, EventTime, KafkaSink, KafkaSource, Pipeline
from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import produce
from onceflow.kernel.keyspace import Keyspace, Kind
from onceflow.kernel.scopes import read_scopes
from onceflow.kernel.settings import RedisSettings, redis_client
from onceflow.kernel.slots import namespace_slot
from onceflow.operations.gc import collect
from onceflow.runtime.spark_env.session import DEFAULT_MASTER, spark_session
from onceflow.testing.kafka import LocalKafka
from onceflow.testing.redis_cluster import LocalRedisCluster

WORKLOADS = ("stateless", "keyed")
EVENT_STEP_MS = 5
EVENT_START_MS = 1_700_000_000_000
# What each kind of key is counted as (the rest is "other": meta, clock, tokens, counters ...).
GROUPS = {
    Kind.SEEN: "seen",
    Kind.BACKUP: "backup",
    Kind.FILTER_SNAPSHOT: "filters",
    Kind.FILTER_JOURNAL: "filters",
    Kind.STATE: "state",
}
GROUP_ORDER = ("seen", "backup", "filters", "state", "other")


@dataclass
class MasterLoad:
    """What one master holds and served for one pipeline."""

    port: int
    keys: int = 0
    bytes_by_group: dict[str, int] = field(default_factory=dict)
    calls: int = 0
    scripts: int = 0
    usec: int = 0
    net_in: int = 0
    net_out: int = 0
    used_memory_delta: int = 0

    @property
    def bytes(self) -> int:
        return sum(self.bytes_by_group.values())


def build(workload: str, name: str, topic: str) -> Pipeline:
    """The pipeline of one workload (see the module's doc); IDs come from the bid's ``n``."""
    p = Pipeline(name, event_time=EventTime.of(out_of_orderness="1s"))
    bids = p.read(
        "bids",
        KafkaSource(topic, codec="json", timestamp=lambda b: b["ts"], id=lambda b: b["n"]),
    )
    if workload == "stateless":
        euros = bids.map("euros", lambda b: {**b, "price": b["price"] * 0.908})
        euros.filter("some-auctions", lambda b: b["auction"] % 5 == 0).write(
            "euro-bids", KafkaSink(f"{name}-out")
        )
    else:
        counts = bids.key_by("by-user", lambda b: b["user"]).count_per_key("count")
        counts.write("counts", KafkaSink(f"{name}-out"))
    return p


def produce_bids(kafka: KafkaSettings, topic: str, records: int, partitions: int) -> None:
    """``records`` bids, 5 ms of event time apart, round robin over ``partitions``."""
    rng = random.Random(1)

    def bids() -> Iterator[tuple[bytes | None, bytes, None]]:
        for i in range(records):
            bid = {
                "user": f"u{rng.randrange(1000)}",
                "auction": rng.randrange(100),
                "price": rng.randrange(1, 10_000),
                "ts": EVENT_START_MS + i * EVENT_STEP_MS,
                "n": i,
            }
            yield str(i).encode(), json.dumps(bid).encode(), None

    produce(kafka, topic, bids(), partitions=partitions)


SCRIPT_COMMANDS = ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_fcall")


def command_stats(cluster: LocalRedisCluster) -> dict[int, tuple[int, ...]]:
    """Per master port: (commands, script calls, main thread CPU us, bytes in, out).

    ``commands`` counts the commands scripts run too (Redis counts them in commandstats),
    so it follows the work; ``script calls`` follows the round trips that carry it.
    """
    out: dict[int, tuple[int, ...]] = {}
    for master in cluster.masters():
        client = cluster.node_client(master.port)
        stats = client.info("commandstats")
        net = client.info("stats")
        calls = sum(int(v["calls"]) for v in stats.values())
        scripts = sum(int(stats[k]["calls"]) for k in SCRIPT_COMMANDS if k in stats)
        cpu = client.info("cpu")
        # the main thread's CPU: commandstats' usec counts a script's commands twice
        usec = round(
            1e6 * (float(cpu["used_cpu_user_main_thread"]) + float(cpu["used_cpu_sys_main_thread"]))
        )
        net_in = int(net["total_net_input_bytes"])
        net_out = int(net["total_net_output_bytes"])
        out[master.port] = (calls, scripts, usec, net_in, net_out)
    return out


def used_memory(cluster: LocalRedisCluster) -> dict[int, int]:
    return {
        m.port: int(cluster.node_client(m.port).info("memory")["used_memory"])
        for m in cluster.masters()
    }


def namespace_memory(cluster: LocalRedisCluster, namespace: str) -> dict[int, MasterLoad]:
    """Keys and bytes (by group) of a namespace and its scopes, per master."""
    loads = {m.port: MasterLoad(m.port) for m in cluster.masters()}
    pattern = f"of:{{{namespace}*"  # the namespace's tag and its scopes' tags
    ks = Keyspace(namespace)
    for port, load in loads.items():
        client = cluster.node_client(port)
        for key in client.scan_iter(match=pattern, count=1000):
            load.keys += 1
            parsed = _parse_any(ks, key)
            group = GROUPS.get(parsed.kind, "other") if parsed is not None else "other"
            size = int(client.memory_usage(key, samples=0) or 0)
            load.bytes_by_group[group] = load.bytes_by_group.get(group, 0) + size
    return loads


def _parse_any(ks: Keyspace, key: str) -> Any:
    """What a key names, in the namespace's own tag or in one of its partition scopes."""
    parsed = ks.parse(key)
    if parsed is not None:
        return parsed
    tag = key[key.index("{") + 1 : key.index("}")]
    scope = tag.partition(":")[2]
    return Keyspace(ks.namespace, scope).parse(key) if scope else None


def spread(values: list[float]) -> float:
    """The largest distance of a value from the mean, over the mean (0.0: all equal)."""
    mean = sum(values) / len(values) if values else 0.0
    return max(abs(v - mean) for v in values) / mean if mean else 0.0


def run_workload(
    args: argparse.Namespace, spark: Any, cluster: LocalRedisCluster, redis_url: str, topic: str
) -> None:
    """One pipeline, measured per master (see the module's doc)."""
    name = f"balance-{args.workload}-{uuid.uuid4().hex[:6]}"
    pipeline = build(args.workload, name, topic)
    workdir = tempfile.mkdtemp(prefix="onceflow-balance-")
    calls0, mem0 = command_stats(cluster), used_memory(cluster)
    started = time.perf_counter()
    result = pipeline.run(
        session=spark,
        redis_url=redis_url,
        guarantee="exactly-once",
        available_now=True,
        parallelism=args.parallelism,
        max_records_per_batch=args.batch,
        checkpoint=os.path.join(workdir, "ckpt"),
        output_dir=workdir,
        dedup=DedupConfig(),
        progress=False,
    )
    seconds = time.perf_counter() - started
    calls1, mem1 = command_stats(cluster), used_memory(cluster)
    loads = namespace_memory(cluster, name)
    for port, load in loads.items():
        (
            load.calls,
            load.scripts,
            load.usec,
            load.net_in,
            load.net_out,
        ) = (after - before for after, before in zip(calls1[port], calls0[port], strict=True))
        load.used_memory_delta = mem1[port] - mem0[port]
    settings = RedisSettings(redis_url)
    scopes = read_scopes(redis_client(settings, name), Keyspace(name))
    tags: dict[int, int] = {}
    for ks in scopes.keyspaces():
        port = cluster.slot_owner(namespace_slot(ks.tag)).port
        tags[port] = tags.get(port, 0) + 1
    print(
        f"\n--- {args.workload}: {result.records_in:,} records in {seconds:.1f} s, "
        f"parallelism {args.parallelism}, namespace {name}"
    )
    print_loads(loads, tags)
    print_costs(loads, result.records_in)
    connect = functools.partial(redis_client, settings)
    collect(redis_client(settings, name), name, connect=connect)
    collected = namespace_memory(cluster, name)
    print("after `onceflow gc` (the batches' backups are garbage once Spark committed them):")
    print_memory(collected)


def print_loads(loads: dict[int, MasterLoad], tags: dict[int, int]) -> None:
    """Memory by group, then the run's commands, script calls, Redis time and bytes."""
    print_memory(loads, tags)
    print(
        f"{'master':<8} {'commands':>9} {'scripts':>8} {'Redis CPU ms':>12} {'net in MB':>10} "
        f"{'net out MB':>10} {'used MB +':>9}"
    )
    for port, load in loads.items():
        print(
            f"{port:<8} {load.calls:>9,} {load.scripts:>8,} {load.usec / 1e3:>12.0f} "
            f"{load.net_in / 1e6:>10.2f} {load.net_out / 1e6:>10.2f} "
            f"{load.used_memory_delta / 1e6:>9.2f}"
        )
    values = list(loads.values())
    print(
        f"spread: commands {spread([float(v.calls) for v in values]):.0%}, "
        f"script calls {spread([float(v.scripts) for v in values]):.0%}, "
        f"Redis CPU {spread([float(v.usec) for v in values]):.0%}"
    )


def print_memory(loads: dict[int, MasterLoad], tags: dict[int, int] | None = None) -> None:
    """The pipeline's keys and bytes per master, by group, and their spread."""
    header = "".join(f"{g + ' MB':>11}" for g in GROUP_ORDER)
    print(f"{'master':<8} {'tags':>4} {'keys':>7}{header} {'total MB':>9}")
    for port, load in loads.items():
        groups = "".join(f"{load.bytes_by_group.get(g, 0) / 1e6:>11.2f}" for g in GROUP_ORDER)
        n_tags = "-" if tags is None else str(tags.get(port, 0))
        print(f"{port:<8} {n_tags:>4} {load.keys:>7}{groups} {load.bytes / 1e6:>9.2f}")
    spread_bytes = spread([float(v.bytes) for v in loads.values()])
    print(f"spread: memory {spread_bytes:.0%} (largest distance from the masters' mean)")


def print_costs(loads: dict[int, MasterLoad], records: int) -> None:
    """Per-record costs over every master: what docs/operations/scale-out.md's model uses."""
    if not records:
        return
    total = MasterLoad(0)
    for load in loads.values():
        total.calls += load.calls
        total.scripts += load.scripts
        total.usec += load.usec
        total.net_in += load.net_in
        total.net_out += load.net_out
        for group, size in load.bytes_by_group.items():
            total.bytes_by_group[group] = total.bytes_by_group.get(group, 0) + size
    per = {
        "Redis CPU us": total.usec / records,
        "commands": total.calls / records,
        "script calls": total.scripts / records,
        "net in B": total.net_in / records,
        "net out B": total.net_out / records,
        "seen B": total.bytes_by_group.get("seen", 0) / records,
        "backup B": total.bytes_by_group.get("backup", 0) / records,
        "filters B": total.bytes_by_group.get("filters", 0) / records,
    }
    print("per record, all masters: " + ", ".join(f"{k} {v:.2f}" for k, v in per.items()))


@contextlib.contextmanager
def services() -> Iterator[tuple[LocalRedisCluster, str, str]]:
    with contextlib.ExitStack() as stack:
        cluster = LocalRedisCluster().start()
        stack.callback(cluster.stop)
        redis_url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in cluster.ports)
        bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
        if not bootstrap:
            bootstrap = stack.enter_context(LocalKafka()).bootstrap
        os.environ["KAFKA_BOOTSTRAP_SERVERS"] = bootstrap  # the pipelines' source and sinks
        yield cluster, redis_url, bootstrap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=25_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--parallelism", type=int, default=6)
    parser.add_argument("--master", default=DEFAULT_MASTER)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    args = parser.parse_args()
    unknown = set(args.workloads.split(",")) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workload(s) {', '.join(sorted(unknown))}")
    with services() as (cluster, redis_url, bootstrap):
        masters = ", ".join(f"{m.port} slots {m.slots}" for m in cluster.masters())
        print(f"Redis Cluster masters: {masters}")
        kafka = KafkaSettings.from_env(bootstrap)
        topic = f"balance-{uuid.uuid4().hex[:6]}"
        t0 = time.perf_counter()
        produce_bids(kafka, topic, args.records, args.partitions)
        print(
            f"produced {args.records:,} bids on {args.partitions} partitions "
            f"in {time.perf_counter() - t0:.1f} s"
        )
        spark = spark_session(args.master, app_name="bench-cluster-balance")
        for workload in args.workloads.split(","):
            args.workload = workload
            run_workload(args, spark, cluster, redis_url, topic)


if __name__ == "__main__":
    main()
