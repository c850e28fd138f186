"""Exactly-once against at-least-once on Kafka-to-Kafka workloads, both ways, in one run.

Workloads (``--workloads``, all by default), on the same input topic of bids
``{user, auction, price, ts}``:

* ``keyed-count``: ``key_by(user) -> count_per_key`` (the headline number); its records
  have no ID of their own, so each is known by its position (cheapest: no seen-mark);
* ``keyed-count-ids``: the same with IDs from the bid's own ``n`` field (``id=``), as a
  pipeline that must drop copies sent twice upstream has them: every ID goes through the
  Bloom filters and is marked seen in Redis;
* ``stateless``: Nexmark q1/q2 shape, ``map`` (price to euros) -> ``filter`` (one auction in
  five) -> sink: no keyed state, one dedup boundary (the sink);
* ``sliding-window``: Nexmark q5 shape, ``key_by(auction) -> window(Sliding 10 s / 2 s) ->
  count``: each bid lands in 5 windows, final panes are emitted as the watermark passes;
* ``fan-out``: one source into two sinks, a stateless copy and a keyed count;
* ``join``: a stage read by two others (issue 37's shape), the topic read by two sources:
  ``asks -> key_by(user) -> count`` and ``bids.join(asks)`` by the bid's ``n`` in windows of
  2 s, each bid paired with its own copy: ``asks`` is cached and read by the count's exchange
  and by the join's merge after ``bids``. Its records/s count both sources' records. Not in
  the default set: ``--workloads join``;
* ``large-docs``: the large-records finding's shape, ``--docs`` JSON documents of
  ``--doc-bytes`` (250 KB by default) on one partition, read in one micro-batch, through a
  ``map`` to a Kafka sink: what commits, deliveries and Arrow batches bounded by bytes cost
  (:mod:`onceflow.kernel.limits`); its numbers are also printed in MB/s. Not in the default
  set: ``--workloads large-docs``.

The baseline is the same pipeline with ``guarantee="at-least-once"``: keyed state in Redis,
but no record IDs, no backup and no dedup. A third mode, ``exactly-once/plain-sink``, is
exactly-once with ``KafkaSink(transactional=False)``: the cost of the transactional sink (the
default) is the difference between the last two. Both read the same topic from the start with a
fresh checkpoint and namespace, alternating, ``--repeat`` times, each in a fresh process (a new
Spark JVM: successive queries in one JVM slow down, for both modes alike) that first runs one
unmeasured warm-up query. Prints records/s (whole run, and steady state without the first
micro-batch of the query) and their ratio, micro-batch latency (p50/p99), peak resident
memory of the driver (Python), the Spark JVM and the Python workers (the largest sum at any
moment) in local mode, Redis round trips per 1,000 records, Redis lookups per 1,000 new IDs
next to the Bloom filters' configured false-positive rate, Bloom filter memory, Redis bytes
per stored ID, and the Redis memory a run left per dedup boundary (seen IDs and filter
journal per receiver, backups per producing stage, keyed state per combine).

    python bench/exactly_once.py [--records 200000] [--batch 50000] [--repeat 3]
        [--workloads keyed-count,keyed-count-ids,stateless,sliding-window,fan-out,join,large-docs]
        [--docs 400] [--doc-bytes 250000]
        [--client python|confluent]
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
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import page
from teardown import own_session, started, stopping_on_signals

from onceflow import DedupConfig, EventTime, KafkaSink, KafkaSource, Pipeline, Sliding
from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import produce
from onceflow.kernel.keyspace import Keyspace, Kind
from onceflow.kernel.scopes import Connect, read_scopes
from onceflow.kernel.settings import RedisSettings, redis_client
from onceflow.runtime.spark_env.session import DEFAULT_MASTER, spark_session
from onceflow.testing.kafka import LocalKafka
from onceflow.testing.redis_cluster import LocalRedisCluster
from onceflow.testing.services import LocalRedis
from onceflow.testing.spark_cluster import LocalSparkCluster

# mode -> (guarantee, transactional Kafka sink)
MODES = {
    "at-least-once": ("at-least-once", False),
    "exactly-once/plain-sink": ("exactly-once", False),
    "exactly-once": ("exactly-once", True),
}


CHILD_TIMEOUT_S = 900  # a measured run's process, warm-up included

READ_IN_TASK_ENV = "ONCEFLOW_BENCH_READ_IN_TASK"  # "0": KafkaSource(read_in_task=False)

# one bid in the input topic per 5 ms of event time (200 bids per second of event time)
EVENT_STEP_MS = 5
EVENT_START_MS = 1_700_000_000_000


def build(
    workload: str,
    name: str,
    topic: str,
    out: str,
    transactional: bool = True,
    client: str = "auto",
) -> Pipeline:
    """The pipeline of one workload (see the module's doc)."""
    p = Pipeline(name, event_time=EventTime.of(out_of_orderness="1s"))
    ids = {"id": lambda b: b["n"]} if workload == "keyed-count-ids" else {}
    in_task = os.environ.get(READ_IN_TASK_ENV, "1") != "0"  # for A/B runs of the reader

    def sink(topic_out: str) -> KafkaSink:
        return KafkaSink(topic_out, transactional=transactional, client=client)

    if workload == "large-docs":
        docs = p.read("docs", KafkaSource(topic, codec="json", client=client, read_in_task=in_task))
        docs.map("stamp", lambda d: {**d, "seen": True}).write("doc-copies", sink(out))
        return p
    bids = p.read(
        "bids",
        KafkaSource(
            topic,
            codec="json",
            timestamp=lambda b: b["ts"],
            client=client,
            read_in_task=in_task,
            **ids,
        ),
    )
    if workload in ("keyed-count", "keyed-count-ids", "fan-out"):
        counts = bids.key_by("by-user", lambda b: b["user"]).count_per_key("count")
        counts.write("counts", sink(out))
    if workload in ("stateless", "fan-out"):
        euros = bids.map("euros", lambda b: {**b, "price": b["price"] * 0.908}).filter(
            "some-auctions", lambda b: b["auction"] % 5 == 0
        )
        euros.write("euro-bids", sink(out + "-euros"))
    if workload == "sliding-window":
        (
            bids.key_by("by-auction", lambda b: b["auction"])
            .window("window", Sliding("10s", "2s"))
            .count_per_key("count")
            .write("hot-auctions", sink(out))
        )
    if workload == JOIN:
        asks = p.read(
            "asks",
            KafkaSource(
                topic,
                codec="json",
                timestamp=lambda b: b["ts"],
                client=client,
                read_in_task=in_task,
            ),
        )
        asks.key_by("by-user", lambda b: b["user"]).count_per_key("count").write(
            "counts", sink(out)
        )
        mine = asks.key_by("ask-n", lambda b: b["n"])
        pairs = bids.key_by("bid-n", lambda b: b["n"]).join("pairs", mine, "2s")
        pairs.write("paired", sink(out + "-pairs"))
    if workload not in (*WORKLOADS, *OPTIONAL):
        raise SystemExit(f"unknown workload {workload!r}; expected one of {', '.join(WORKLOADS)}")
    return p


WORKLOADS = ("keyed-count", "keyed-count-ids", "stateless", "sliding-window", "fan-out")
LARGE_DOCS = "large-docs"  # not in the default set (see the module's doc)
JOIN = "join"  # not in the default set either
OPTIONAL = (JOIN, LARGE_DOCS)


def run_once(
    spark: Any,
    mode: str,
    args: argparse.Namespace,
    redis_url: str,
    workdir: str,
    config: DedupConfig,
) -> dict[str, Any]:
    guarantee, transactional = MODES[mode]
    records, batch = args.records, args.batch
    name = f"bench-{guarantee[:2]}-{uuid.uuid4().hex[:6]}"
    pipeline = build(args.workload, name, args.topic, f"{name}-out", transactional, args.client)
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
    if args.workload == JOIN:  # two sources read the topic
        records *= 2
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
    """Redis (or a Redis Cluster) and Kafka, stopped on every way out (``bench/teardown.py``)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(stopping_on_signals())
        cluster = None
        if redis_cluster:
            cluster = started(stack, LocalRedisCluster())
            seeds = ",".join(f"127.0.0.1:{port}" for port in cluster.ports)
            redis_url = f"redis+cluster://{seeds}"
        else:
            redis_url = os.environ.get("REDIS_URL") or started(stack, LocalRedis()).url
        bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
        if not bootstrap:
            kafka = started(stack, LocalKafka())
            bootstrap = kafka.bootstrap
            if kafka.proc is not None:  # its CPU is measured beside the run's
                os.environ[BROKER_PID_ENV] = str(kafka.proc.pid)
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
    run_once(spark, args.child, args, redis_url, workdir, config)
    before = redis_cpu(redis_url)
    broker = os.environ.get(BROKER_PID_ENV)
    others = {"broker": int(broker)} if broker else {}
    with PeakRss(os.getpid(), others=others) as peak:
        result = run_once(spark, args.child, args, redis_url, workdir, config)
    result["rss_mb"] = peak.peaks_mb()
    result["cpu_s"] = peak.cpu_seconds()
    after = redis_cpu(redis_url)
    if before is not None and after is not None:
        result["redis_cpu_s"] = {k: after[k] - before[k] for k in after}
    print("RESULT " + json.dumps(result))


def redis_cpu(redis_url: str) -> dict[str, float] | None:
    """CPU seconds one Redis server has spent so far: in all, in scripts, in seen-marks.

    ``total`` is the main thread's user + system time (INFO cpu), ``scripts`` the time inside
    EVALSHA calls (Lua and the commands it runs), ``hsetnx`` that of the commit script's
    seen-mark writes (INFO commandstats). None for a Redis Cluster (one server is not the
    whole store) or when the server does not say.
    """
    settings = RedisSettings.from_env(redis_url)
    if settings.cluster:
        return None
    client = redis_client(settings)
    try:
        cpu = client.info("cpu")
        stats = client.info("commandstats")
    finally:
        client.close()
    if "used_cpu_user_main_thread" not in cpu:
        return None

    def usec(command: str) -> float:
        return float(stats.get(f"cmdstat_{command}", {}).get("usec", 0)) / 1e6

    return {
        "total": float(cpu["used_cpu_user_main_thread"]) + float(cpu["used_cpu_sys_main_thread"]),
        "scripts": usec("evalsha") + usec("eval"),
        "hsetnx": usec("hsetnx"),
    }


_TICKS = os.sysconf("SC_CLK_TCK")
BROKER_PID_ENV = "ONCEFLOW_BENCH_BROKER_PID"


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of one process so far (None if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


class PeakRss:
    """Peak memory and CPU of a process tree, sampled every 0.5 s from /proc (Linux).

    Memory is the proportional set size (PSS: a page shared by n processes counts 1/n in
    each), so PySpark's forked workers, which share their parent daemon's imported modules, are
    not counted once per worker. Peaks of the driver (this Python process), the JVMs among its
    descendants (Spark's, in local mode), the largest sum at one moment of the other Python
    descendants (PySpark's daemon and workers) and their largest number. Executors of a
    standalone cluster are not descendants: not counted.

    CPU (user + system) is what each process spent between the first sample and its last,
    by the same kinds, plus the processes named in ``others`` (the broker): a process that
    ends between two samples loses at most one interval of it.
    """

    PARTS = ("driver", "jvm", "python workers", "worker processes")
    CPU_PARTS = ("driver", "jvm", "python workers")

    # A sample reads /proc/<pid>/smaps_rollup of every process of the tree: ~10-50 ms of this
    # process's CPU (the JVM's is long), which every mode pays alike.
    def __init__(self, root: int, interval: float = 0.5, others: dict[str, int] | None = None):
        self.root = root
        self.interval = interval
        self.others = dict(others or {})
        self.peak = dict.fromkeys(self.PARTS, 0)
        self.cpu_start: dict[int, float] = {}
        self.cpu_last: dict[int, tuple[str, float]] = {}
        self._first = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="peak-rss")

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval):
                self.sample()
                return

    def _kind(self, pid: int, comm: str) -> str | None:
        if pid == self.root:
            return "driver"
        if comm == "java":
            return "jvm"
        if comm.startswith("python"):
            return "python workers"
        return None

    def sample(self) -> None:
        now = dict.fromkeys(self.PARTS, 0)
        for pid, comm, pss, cpu in self._tree():
            kind = self._kind(pid, comm)
            if kind is None:
                continue
            now[kind] += pss
            if kind == "python workers":
                now["worker processes"] += 1
            self._cpu(pid, kind, cpu)
        for name, pid in self.others.items():
            cpu = _cpu_seconds(pid)
            if cpu is not None:
                self._cpu(pid, name, cpu)
        self._first = False
        for part, value in now.items():
            self.peak[part] = max(self.peak[part], value)

    def _cpu(self, pid: int, kind: str, cpu: float) -> None:
        if pid not in self.cpu_start:
            self.cpu_start[pid] = cpu if self._first else 0.0
        self.cpu_last[pid] = (kind, cpu)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds spent while measured, by kind of process."""
        out = dict.fromkeys((*self.CPU_PARTS, *self.others), 0.0)
        for pid, (kind, cpu) in self.cpu_last.items():
            out[kind] += cpu - self.cpu_start[pid]
        return out

    def _tree(self) -> Iterator[tuple[int, str, int, float]]:
        """(pid, command name, PSS bytes, CPU seconds) of the root and its descendants."""
        parents: dict[int, int] = {}
        names: dict[int, str] = {}
        cpus: dict[int, float] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            parents[int(entry)] = int(fields[1])
            names[int(entry)] = comm
            cpus[int(entry)] = (int(fields[11]) + int(fields[12])) / _TICKS
        inside, grown = {self.root}, {self.root}
        while grown:  # a generation of descendants at a time
            grown = {p for p, parent in parents.items() if parent in grown} - inside
            inside |= grown
        for pid in inside:
            try:
                with open(f"/proc/{pid}/smaps_rollup") as f:
                    pss = next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
            except (OSError, IndexError, ValueError, StopIteration):
                continue  # the process ended
            yield pid, names.get(pid, ""), pss * 1024, cpus.get(pid, 0.0)

    def peaks_mb(self) -> dict[str, float]:
        """Peaks in MB (the process count as it is)."""
        return {
            part: value if part == "worker processes" else value / 1e6
            for part, value in self.peak.items()
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=50_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--master", default=DEFAULT_MASTER)
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated, of {', '.join((*WORKLOADS, *OPTIONAL))} (default: all but "
        f"{', '.join(OPTIONAL)})",
    )
    parser.add_argument(
        "--client",
        choices=("python", "confluent"),
        default="confluent",  # what client="auto" picks where confluent-kafka is installed
        help="Kafka client of sources and sinks (default confluent, as client='auto' picks)",
    )
    parser.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--workload", choices=(*WORKLOADS, *OPTIONAL), help=argparse.SUPPRESS)
    parser.add_argument("--docs", type=int, default=400, help="large-docs: documents")
    parser.add_argument("--doc-bytes", type=int, default=250_000, help="large-docs: their size")
    parser.add_argument("--topic", help=argparse.SUPPRESS)
    parser.add_argument("--redis-cluster", action="store_true")
    parser.add_argument("--spark-cluster", action="store_true")
    parser.add_argument(
        "--markdown",
        metavar="PATH",
        help="also write the summary as a Markdown page (docs/benchmarks.md is made this way)",
    )
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    unknown = set(args.workloads.split(",")) - {*WORKLOADS, *OPTIONAL}
    if unknown:
        parser.error(f"unknown workload(s) {', '.join(sorted(unknown))}")
    with contextlib.ExitStack() as stack:
        stack.enter_context(stopping_on_signals())
        masters = [args.master]
        if args.spark_cluster:
            spark_cluster = started(stack, LocalSparkCluster(workers=2, cores=1))
            masters.append(spark_cluster.master_url)
        redis_url, bootstrap, cluster = stack.enter_context(services(args.redis_cluster))
        for master in masters:
            bench_on(args, master, redis_url, bootstrap, cluster)


def produce_bids(kafka: KafkaSettings, topic: str, records: int) -> None:
    """The benchmarks' input: ``records`` bids on 2 partitions, 5 ms of event time apart."""
    rng = random.Random(1)
    bids = (
        (
            None,
            json.dumps(
                {
                    "user": f"u{rng.randrange(1000)}",
                    "auction": rng.randrange(100),
                    "price": rng.randrange(1, 10_000),
                    "ts": EVENT_START_MS + i * EVENT_STEP_MS,
                    "n": i,
                }
            ).encode(),
            None,
        )
        for i in range(records)
    )
    produce(kafka, topic, bids, partitions=2)


def produce_docs(kafka: KafkaSettings, topic: str, docs: int, size: int) -> None:
    """The large-docs input: ``docs`` JSON documents of ``size`` bytes on one partition."""
    body = "d" * max(0, size - 60)
    values = (
        (None, json.dumps({"n": i, "user": f"u{i % 100}", "body": body}).encode(), None)
        for i in range(docs)
    )
    produce(kafka, topic, values, partitions=1)


def bench_on(
    args: argparse.Namespace,
    master: str,
    redis_url: str,
    bootstrap: str,
    cluster: LocalRedisCluster | None,
) -> None:
    """Every workload and mode ``--repeat`` times on one Spark master; the report."""
    args = argparse.Namespace(**{**vars(args), "master": master})
    print(f"\n=== Spark master {master}, Redis {redis_url.rsplit('@', maxsplit=1)[-1]}")
    print(f"Kafka client: {args.client}")
    before = node_commands(cluster) if cluster is not None else {}
    kafka = KafkaSettings.from_env(bootstrap)
    args.topic = f"bench-{uuid.uuid4().hex[:6]}"
    t0 = time.perf_counter()
    produce_bids(kafka, args.topic, args.records)
    print(f"produced {args.records:,} records in {time.perf_counter() - t0:.1f} s")
    env = {**os.environ, "REDIS_URL": redis_url, "KAFKA_BOOTSTRAP_SERVERS": bootstrap}
    # a local standalone cluster shares this machine's disk: checkpoints under /tmp are shared
    env["ONCEFLOW_SHARED_DIRS"] = tempfile.gettempdir()
    settings = RedisSettings(redis_url)

    def connect(tag: str) -> Any:
        return redis_client(settings, tag)

    summary: dict[str, dict[str, list[dict[str, Any]]]] = {}
    names: set[str] = set()
    for workload in args.workloads.split(","):
        args.workload = workload
        print(f"\n--- workload {workload}")
        run_args = args
        if workload == LARGE_DOCS:
            run_args = large_docs_args(args, kafka)
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
        for i in range(args.repeat):
            for mode in MODES:
                r = spawn(mode, run_args, env)
                runs[mode].append(r)
                names.add(r["name"])
                print(
                    f"  run {i + 1} {mode:<24} {r['seconds']:6.1f} s  "
                    f"{r['rate']:>8,.0f} rec/s overall  {r['steady']:>8,.0f} rec/s steady "
                    f"({r['batches']} batches, p50 {r['p50_s']:.2f} s, p99 {r['p99_s']:.2f} s)",
                    flush=True,
                )
        if workload == LARGE_DOCS:
            print_megabytes(runs, args.doc_bytes)
        records = run_args.records * (2 if workload == JOIN else 1)  # read by two sources
        report(runs, records, connect, DedupConfig(), local=master.startswith("local"))
        summary[workload] = runs
    if len(summary) > 1:
        print_summary(summary)
    if args.markdown:
        write_markdown(args.markdown, summary, args, master)
        print(f"\nwrote {args.markdown}")
    if cluster is not None:
        print_nodes(cluster, before, names, connect)


def large_docs_args(args: argparse.Namespace, kafka: KafkaSettings) -> argparse.Namespace:
    """The large-docs workload's own input and sizes: the documents in four micro-batches."""
    topic = f"bench-docs-{uuid.uuid4().hex[:6]}"
    t0 = time.perf_counter()
    produce_docs(kafka, topic, args.docs, args.doc_bytes)
    print(
        f"produced {args.docs:,} documents of {args.doc_bytes:,} bytes "
        f"({args.docs * args.doc_bytes / 1e6:,.0f} MB) in {time.perf_counter() - t0:.1f} s"
    )
    batch = max(1, args.docs // 4)
    sizes = {"topic": topic, "records": args.docs, "batch": batch}
    return argparse.Namespace(**{**vars(args), **sizes})


def print_megabytes(runs: dict[str, list[dict[str, Any]]], doc_bytes: int) -> None:
    """Each mode's median throughput in MB/s of input documents (overall and steady)."""
    print()
    for mode, rs in runs.items():
        overall = statistics.median(r["rate"] for r in rs) * doc_bytes / 1e6
        steady = statistics.median(r["steady"] for r in rs) * doc_bytes / 1e6
        print(f"{mode:<34} {overall:>8.1f} MB/s overall {steady:>8.1f} MB/s steady")


def print_summary(summary: dict[str, dict[str, list[dict[str, Any]]]]) -> None:
    """Every workload's medians and ratios on one table."""
    print("\nAll workloads (median rec/s overall / steady; ratios to at-least-once)")
    print(
        f"{'workload':<16} {'at-least-once':>17} {'exactly-once plain':>19} "
        f"{'exactly-once':>17} {'EO/ALO':>12} {'plain/ALO':>12}"
    )
    for workload, runs in summary.items():
        med = {
            m: (
                statistics.median(r["rate"] for r in rs),
                statistics.median(r["steady"] for r in rs),
            )
            for m, rs in runs.items()
        }
        alo, plain, eo = med["at-least-once"], med["exactly-once/plain-sink"], med["exactly-once"]
        print(
            f"{workload:<16} {alo[0]:>8,.0f}/{alo[1]:<8,.0f} {plain[0]:>9,.0f}/{plain[1]:<9,.0f} "
            f"{eo[0]:>8,.0f}/{eo[1]:<8,.0f} {eo[0] / alo[0]:>5.0%}/{eo[1] / alo[1]:<5.0%} "
            f"{plain[0] / alo[0]:>5.0%}/{plain[1] / alo[1]:<5.0%}"
        )


def _median_spread(rs: list[dict[str, Any]], key: str) -> str:
    """``median (min..max)`` of one measure over repeated runs, in records/s."""
    values = [r[key] for r in rs]
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}..{max(values):,.0f})"


def write_markdown(
    path: str,
    summary: dict[str, dict[str, list[dict[str, Any]]]],
    args: argparse.Namespace,
    master: str,
) -> None:
    """The benchmark page: today's numbers only, one row per workload, the baseline beside."""
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `python bench/exactly_once.py --records {args.records} --batch "
        f"{args.batch} --repeat {args.repeat} --workloads {args.workloads} --client "
        f"{args.client} --markdown {path}` on {time.strftime('%Y-%m-%d')} "
        f"({os.cpu_count()} cores, Spark `{master}`, "
        f"Kafka client {args.client}; Redis and Apache Kafka on the same machine). Do not edit "
        "by hand: run the command again.",
        "",
        "Records/s through a Kafka-to-Kafka pipeline, median of the runs with the spread "
        "(min..max) beside it; *overall* from the query's start to its last batch, *steady* "
        "without its first micro-batch. The baseline is the same pipeline at least once (keyed "
        "state in Redis, no IDs, backup or dedup), run alternately with the exactly-once one "
        "in fresh processes on the same input.",
        "",
        "| workload | at-least-once (baseline) overall | exactly-once overall | exactly-once "
        "/ baseline | at-least-once steady | exactly-once steady | exactly-once, plain sink, "
        "overall |",
        "|---|---|---|---|---|---|---|",
    ]
    for workload, runs in summary.items():
        alo, eo, plain = (
            runs["at-least-once"],
            runs["exactly-once"],
            runs["exactly-once/plain-sink"],
        )
        ratio = statistics.median(r["rate"] for r in eo) / statistics.median(r["rate"] for r in alo)
        lines.append(
            f"| {workload} | {_median_spread(alo, 'rate')} | {_median_spread(eo, 'rate')} | "
            f"{ratio:.0%} | {_median_spread(alo, 'steady')} | {_median_spread(eo, 'steady')} | "
            f"{_median_spread(plain, 'rate')} |"
        )
    lines += [
        "",
        "The workloads: `keyed-count` counts bids per user (position IDs), `keyed-count-ids` the "
        "same with IDs from each bid (every ID through the Bloom filters and Redis), "
        "`stateless` a map and filter to a sink, `sliding-window` a windowed count per "
        "auction, `fan-out` one source into a copy and a keyed count. See the module docstring "
        "of `bench/exactly_once.py` for what else it prints (latency per batch, memory, Redis "
        "round trips and bytes per ID).",
        "",
    ]
    lines.append(page.kept(path))
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines))


def child_command(guarantee: str, args: argparse.Namespace) -> list[str]:
    """The command of one measured run in a fresh process (``bench/profile_workers.py`` too)."""
    return [
        sys.executable,
        __file__,
        "--child",
        guarantee,
        "--workload",
        getattr(args, "workload", None) or "keyed-count",
        "--client",
        getattr(args, "client", None) or "python",
        "--topic",
        args.topic,
        "--records",
        str(args.records),
        "--batch",
        str(args.batch),
        "--master",
        args.master,
    ]


def spawn(guarantee: str, args: argparse.Namespace, env: dict[str, str]) -> Any:
    """Run one measured query in a fresh process tree; return its result.

    The tree (the child, its Spark JVM and Python workers) is killed whole when the child
    ends, times out or the benchmark is stopped.
    """
    cmd = child_command(guarantee, args)
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    with own_session(cmd, env=env, **pipes) as proc:
        stdout, stderr = proc.communicate(timeout=CHILD_TIMEOUT_S)
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    msg = f"benchmark child failed ({proc.returncode}):\n{stdout[-2000:]}\n{stderr[-3000:]}"
    raise RuntimeError(msg)


def report(
    runs: dict[str, list[dict[str, Any]]],
    records: int,
    connect: Connect,
    config: DedupConfig,
    local: bool,
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
    if local:
        print_rss(runs)
        print_cpu(runs, records)
    print_redis_cpu(runs, records)
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
    client = connect(last["name"])
    seen_bytes, seen_ids, generations = redis_footprint(client, last["name"], connect)
    new_ids = max(seen_ids, 1)  # every new ID is stored once (no GC ran)
    filter_bytes = int(-config.bloom_capacity * math.log(config.bloom_error) / math.log(2) ** 2 / 8)
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
    for mode in ("exactly-once", "at-least-once"):
        print_boundaries(mode, runs[mode][-1]["name"], connect, records)


def print_redis_cpu(runs: dict[str, list[dict[str, Any]]], records: int) -> None:
    """Redis server CPU per 100k records of the measured query (median), per mode.

    Python's profile (bench/profile_workers.py) does not see it, yet on a small machine it
    competes with Spark's workers for the same cores.
    """
    scale = 100_000 / records
    rows = []
    for mode, rs in runs.items():
        cpus = [r["redis_cpu_s"] for r in rs if r.get("redis_cpu_s")]
        if cpus:
            rows.append((mode, [statistics.median(c[k] for c in cpus) * scale for k in cpus[0]]))
    if not rows:
        return
    print()
    print(
        f"{'Redis server CPU s per 100k records':<34} {'total':>8} {'scripts':>8} "
        f"{'of which seen-mark HSETNX':>26}"
    )
    for mode, (total, scripts, hsetnx) in rows:
        print(f"{mode:<34} {total:>8.2f} {scripts:>8.2f} {hsetnx:>26.2f}")


def print_cpu(runs: dict[str, list[dict[str, Any]]], records: int) -> None:
    """CPU seconds per 100k records of the measured query (median), by kind of process.

    On two cores everything competes: the Kafka broker's work (transactions, headers) is as
    much a cost of a mode as the workers'.
    """
    scale = 100_000 / records
    rows = []
    for mode, rs in runs.items():
        cpus = [r["cpu_s"] for r in rs if r.get("cpu_s")]
        if cpus:
            kinds = list(cpus[0])
            rows.append(
                (mode, kinds, [statistics.median(c[k] for c in cpus) * scale for k in kinds])
            )
    if not rows:
        return
    kinds = rows[0][1]
    print()
    print(
        f"{'CPU s per 100k records, median':<34}" + "".join(f"{k:>15}" for k in kinds) + "   total"
    )
    for mode, _kinds, values in rows:
        print(f"{mode:<34}" + "".join(f"{v:>15.2f}" for v in values) + f"{sum(values):>8.2f}")


def print_rss(runs: dict[str, list[dict[str, Any]]]) -> None:
    """Peak resident memory per mode (median of the runs' peaks)."""
    print()
    print(
        f"{'peak memory (PSS), MB, median':<34} {'driver':>8} {'JVM':>8} {'Py workers':>11} "
        f"{'(processes)':>12}"
    )
    for mode, rs in runs.items():
        peaks = [r["rss_mb"] for r in rs if "rss_mb" in r]
        if not peaks:
            continue
        cells = [statistics.median(p.get(part, 0) for p in peaks) for part in PeakRss.PARTS]
        print(
            f"{mode:<34} {cells[0]:>8,.0f} {cells[1]:>8,.0f} {cells[2]:>11,.0f} {cells[3]:>12.0f}"
        )


# what a key holds, for the memory per boundary
_KIND_GROUP = {
    Kind.SEEN: "seen IDs",
    Kind.FILTER_JOURNAL: "filters",
    Kind.FILTER_SNAPSHOT: "filters",
    Kind.FILTER_SEQ: "filters",
    Kind.STATS: "filters",
    Kind.PENDING: "filters",
    Kind.BACKUP: "backups",
    Kind.STATE: "state",
    Kind.EVENT_TIMERS: "state",
    Kind.PROCESSING_TIMERS: "state",
    Kind.EXPIRY: "state",
}
_GROUPS = ("seen IDs", "filters", "backups", "state")


def print_boundaries(mode: str, namespace: str, connect: Connect, records: int) -> None:
    """Redis memory a run left, by receiver (seen IDs, filters), stage (backups), combine.

    Receivers are named after the stage whose input they guard (a sink's after its output);
    backups after the stage that wrote them. The rest (batch parameters, clock, tokens ...)
    is on the ``pipeline`` line.
    """
    table: dict[str, dict[str, int]] = {}
    for ks in read_scopes(connect(namespace), Keyspace(namespace)).keyspaces():
        tagged = connect(ks.tag)
        for key in tagged.scan_iter(match=ks.pattern(), count=1000):
            parsed = ks.parse(key)
            size = tagged.memory_usage(key, samples=0) or 0
            group = _KIND_GROUP.get(parsed.kind) if parsed else None
            name = parsed.name if group and parsed and parsed.name else "pipeline"
            row = table.setdefault(name, dict.fromkeys((*_GROUPS, "other"), 0))
            row[group or "other"] += size
    total = sum(sum(row.values()) for row in table.values())
    print()
    print(
        f"Redis memory left by the last {mode} run: {total / 1e6:.1f} MB, "
        f"{total / records:.0f} B per input record"
    )
    print(
        f"  {'receiver / stage / combine':<30}" + "".join(f"{g:>10}" for g in _GROUPS) + "   other"
    )
    for name, row in sorted(table.items()):
        cells = "".join(f"{row[g] / 1e6:>9.2f}M" for g in _GROUPS)
        print(f"  {name[:30]:<30}{cells}{row['other'] / 1e6:>7.2f}M")


if __name__ == "__main__":
    main()
