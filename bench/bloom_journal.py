"""The Bloom journal of a source stage whose partitions commit concurrently (issue 26, item 4).

Every commit to a receiver appends its IDs to the receiver's Bloom journal; a snapshot of a
worker's filters trims it (:mod:`onceflow.dedup.trust`). This runs "an hour of batches" of one
source stage with 2 and 4 partitions committing at the same time, and prints how the journal
grows, how often snapshots were taken and refused, and what a worker that starts empty (a new
or restarted Python worker) reads when it opens a task.

No Spark: the driver fixes each micro-batch's parameters as a run does
(:func:`onceflow.dedup.batch.fix_batch_params`) and hands the batch's tasks (one per Kafka
partition) to a pool of long-lived worker processes, the way Spark hands tasks to its reused
Python workers: whichever worker is free takes the next task, so a partition moves between
workers and each worker's filters (cached per process, ``trust._FILTERS``) fall behind the
other workers' commits. A task is the real task code (:class:`onceflow.runtime.task.loop.TaskRun`
over the raw rows the Kafka reader hands Spark: decode, admit, commit, finish, close) against a
real Redis. Batches follow each other without waiting for a trigger's second: the batch times
and event times are an hour's worth, the wall time is what the work takes.

    python bench/bloom_journal.py [--partitions 2,4] [--workers 0] [--batches 3600]
        [--events 250] [--chunk 2500] [--every 300]

``--workers 0``: one worker per partition (all of a batch's tasks at once); ``--workers 2`` with
4 partitions is Spark's ``local[2]`` (two waves per batch). Uses REDIS_URL when set, else starts
a local redis-server.

Columns, every ``--every`` batches: the receiver's commits; the journal's entries and KB (Redis's
MEMORY USAGE); the snapshot's KB and the commits after it (behind); in the window, snapshots
taken and refused as stale (or not sent: one covering as much was there), MB of filters
snapshots sent to Redis, journal entries a task caught up from, tasks that reloaded the whole
snapshot, catch-up ms per task; then what a worker that starts empty reads at open (KB of the
CATCH_UP reply), its open's ms and the journal entries it applied.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import queue
import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson
import pyarrow as pa

from onceflow.connectors.kafka import KafkaSink, KafkaSource
from onceflow.connectors.kafka.worker import RAW_COLUMNS
from onceflow.dedup import trust
from onceflow.dedup.batch import fix_batch_params
from onceflow.dedup.config import DedupConfig
from onceflow.dedup.guard import ExactlyOnceGuards
from onceflow.kernel.eventtime import EventTime
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.records import TaskRef
from onceflow.kernel.scopes import pin_scopes, raise_epochs
from onceflow.kernel.scripts import CATCH_UP
from onceflow.kernel.settings import RedisSettings, redis_client
from onceflow.pipeline import Pipeline
from onceflow.runtime.driver.pinning import pin_settings
from onceflow.runtime.spec import StageSpec
from onceflow.runtime.task.loop import TaskRun
from onceflow.testing.services import LocalRedis

TOPIC = "events"
SOURCE = "events"
BATCH_MS = 1000  # a 1 s trigger: each batch is a second of event time
PROBE_PARTITION = 10_000  # a partition no real task uses: the new worker's probe claims it


def source_stage(name: str) -> StageSpec:
    """The source stage of a README-style pipeline: events keyed by user into a running count.

    The source stage is the one whose partitions share a receiver (a copy of a record may come
    in any Kafka partition); the keyed stage after the exchange keeps one per partition.
    """
    p = Pipeline(name, event_time=EventTime.of(out_of_orderness="1s"))
    source = KafkaSource(
        TOPIC,
        bootstrap_servers="127.0.0.1:1",  # never contacted: the task gets raw rows
        codec="json",
        timestamp=lambda e: e["ts"],
        id=lambda e: e["n"],
    )
    counts = p.read(SOURCE, source).key_by("by-user", lambda e: e["user"]).count_per_key("count")
    counts.write("counts", KafkaSink("counts", bootstrap_servers="127.0.0.1:1"))
    return p.job().stages[0]


def raw_rows(start_ms: int, batch: int, partition: int, events: int) -> pa.RecordBatch:
    """One Kafka partition's records of one batch, as the reader hands them to Spark."""
    first = batch * events
    offsets = range(first, first + events)
    step = BATCH_MS // max(1, events)
    tss = [start_ms + batch * BATCH_MS + (o - first) * step for o in offsets]
    values = [
        orjson.dumps({"user": f"u{(o * 7 + partition) % 1000}", "ts": ts, "n": f"{partition}-{o}"})
        for o, ts in zip(offsets, tss, strict=True)
    ]
    return pa.RecordBatch.from_arrays(
        [
            pa.array([TOPIC] * events, pa.string()),
            pa.array([partition] * events, pa.int32()),
            pa.array(offsets, pa.int64()),
            pa.array(tss, pa.int64()),
            pa.array([None] * events, pa.binary()),
            pa.array(values, pa.binary()),
            pa.array([None] * events, pa.binary()),
        ],
        names=list(RAW_COLUMNS),
    )


@dataclass(frozen=True)
class Task:
    batch: int
    partition: int
    attempt_id: int
    batch_json: str


def worker(
    name: str, guards: ExactlyOnceGuards, start_ms: int, events: int, todo: Any, done: Any
) -> None:
    """A reused Python worker: runs tasks until told to stop; its filters live in this process."""
    spec = source_stage(name)
    catch_up = trust.catch_up
    spent: list[float] = []

    def timed(*args: Any) -> None:
        t0 = time.perf_counter()
        catch_up(*args)
        spent.append(time.perf_counter() - t0)

    trust.catch_up = timed  # type: ignore[assignment]  # the guard calls it through the module
    while (task := todo.get()) is not None:
        spent.clear()
        ref = TaskRef(spec.name, task.batch, task.partition, 0, spec.sinks, task.attempt_id)
        run = TaskRun(spec, guards.with_batch_json(task.batch_json), ref)
        for _ in run.run(iter([raw_rows(start_ms, task.batch, task.partition, events)])):
            pass
        run.close(True)
        counters = {k.split("/", 1)[1]: v for k, v in run.counters.items() if "/" in k}
        counters["catch_up_us"] = int(sum(spent) * 1e6)
        done.put(counters)


class Namespace:
    """A pipeline namespace set up as a run's driver does, and its source receiver's keys."""

    def __init__(self, redis_url: str, name: str, config: DedupConfig) -> None:
        self.settings = RedisSettings(redis_url)
        self.ks = Keyspace(name)
        self.client = redis_client(self.settings, self.ks.namespace)
        self.config = config
        pin_settings(self.client, self.ks, 1, config)
        stages = [SOURCE, "by-user"]
        scopes = pin_scopes(self.client, self.ks, ["by-user"], stages, frozenset(), 1, True)
        self.epoch = int(self.client.incr(self.ks.epoch))
        raise_epochs(scopes, self.epoch, lambda tag: redis_client(self.settings, tag))
        self.guards = ExactlyOnceGuards(
            self.settings, self.ks.namespace, self.epoch, config, scoped=scopes.stages
        )
        self.probes = 0

    def batch_json(self, batch: int) -> str:
        params = fix_batch_params(
            self.client, self.ks, self.epoch, batch, self.config, EventTime.of("1s")
        )
        return self.guards.for_batch(params).batch_json()

    def journal(self) -> tuple[int, int, int, int, int]:
        """Journal entries and bytes (MEMORY USAGE), snapshot bytes and seq, commits."""
        ks, c = self.ks, self.client
        pipe = c.pipeline(transaction=False)
        pipe.llen(ks.filter_journal(SOURCE))
        pipe.memory_usage(ks.filter_journal(SOURCE))
        pipe.memory_usage(ks.filter_snapshot(SOURCE))
        pipe.hget(ks.filter_snapshot(SOURCE), trust.SEQ_FIELD)
        pipe.get(ks.filter_seq(SOURCE))
        n, size, snap, snap_seq, seq = pipe.execute()
        return int(n), int(size or 0), int(snap or 0), int(snap_seq or 0), int(seq or 0)

    def new_worker_open(self, batch: int, batch_json: str) -> tuple[int, float, int]:
        """What a worker that starts empty reads at open: reply bytes, ms, entries applied.

        The probe is a task of a partition no real task uses (its own task token), opened in
        this process, whose filter cache is empty.
        """
        ks = self.ks
        keys = [ks.filter_seq(SOURCE), ks.filter_journal(SOURCE), ks.filter_snapshot(SOURCE)]
        reply = self.client.eval(CATCH_UP, len(keys), *keys, 0)
        size = sum(len(x) for part in reply[2:] for x in part)
        trust._FILTERS.clear()
        spec = source_stage(ks.namespace)
        self.probes += 1
        ref = TaskRef(spec.name, batch, PROBE_PARTITION, 0, spec.sinks, self.probes)
        guard = self.guards.with_batch_json(batch_json)(ref)
        t0 = time.perf_counter()
        guard.open()
        ms = (time.perf_counter() - t0) * 1e3
        trust._FILTERS.clear()
        return size, ms, guard.session.counters.get("bloom_journal_entries", 0)


@dataclass
class Window:
    """Counters of the tasks since the last printed line."""

    tasks: int = 0
    snapshots: int = 0
    stale: int = 0
    entries: int = 0
    reloads: int = 0
    sent: int = 0
    catch_up_us: int = 0

    def add(self, counters: dict[str, int]) -> None:
        self.tasks += 1
        self.snapshots += counters.get("bloom_snapshots", 0)
        self.stale += counters.get("bloom_snapshots_stale", 0)
        self.entries += counters.get("bloom_journal_entries", 0)
        self.reloads += counters.get("bloom_loaded_snapshots", 0)
        self.sent += counters.get("bloom_snapshot_bytes", 0)
        self.catch_up_us += counters.get("catch_up_us", 0)


HEADER = (
    f"{'batch':>6}{'commits':>9}{'journal':>9}{'KB':>8}{'snap KB':>9}{'behind':>8}"
    f"{'snaps':>7}{'stale':>7}{'sent MB':>9}{'entries/task':>14}{'reloads':>9}{'catch-up ms':>13}"
    f"{'new worker KB':>15}{'ms':>8}{'entries':>9}"
)


def run(partitions: int, workers: int, args: argparse.Namespace, redis_url: str) -> dict[str, Any]:
    """One source stage of ``partitions`` partitions for ``args.batches`` batches."""
    name = f"journal-{partitions}p-{uuid.uuid4().hex[:6]}"
    ns = Namespace(redis_url, name, DedupConfig(chunk_size=args.chunk))
    start_ms = int(time.time() * 1000) - (args.batches * BATCH_MS) - 3_600_000
    ctx = mp.get_context("spawn")
    todo, done = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(name, ns.guards, start_ms, args.events, todo, done))
        for _ in range(workers)
    ]
    for proc in procs:
        proc.start()
    window, total = Window(), Window()
    attempt, peak = 0, 0
    print(
        f"\n--- {partitions} partitions, {workers} workers, {args.events} events per partition "
        f"per batch in commits of {args.chunk}, {args.batches} batches"
    )
    print(HEADER)
    t0 = time.perf_counter()
    try:
        for batch in range(args.batches):
            text = ns.batch_json(batch)
            for p in range(partitions):
                attempt += 1
                todo.put(Task(batch, p, attempt, text))
            for _ in range(partitions):
                counters = _result(done, procs)
                window.add(counters)
                total.add(counters)
            n, _size, _snap, _snap_seq, _seq = ns.journal()
            peak = max(peak, n)
            if (batch + 1) % args.every == 0 or batch + 1 == args.batches:
                _line(ns, batch, text, window)
                window = Window()
    finally:
        for _ in procs:
            todo.put(None)
        for proc in procs:
            proc.join(30)
    n, size, snap, _snap_seq, seq = ns.journal()
    wall = time.perf_counter() - t0
    new_bytes, new_ms, _ = ns.new_worker_open(args.batches - 1, ns.batch_json(args.batches - 1))
    tried = total.snapshots + total.stale
    print(
        f"after {args.batches} batches ({wall:.0f} s): {seq} commits, journal {n} entries "
        f"({size / 1024:.0f} KB, peak {peak} entries), snapshot {snap / 1024:.0f} KB; snapshots "
        f"{total.snapshots} taken, {total.stale} refused as stale"
        f" ({100 * total.stale / max(1, tried):.0f}% of {tried} tried); {total.reloads} of "
        f"{total.tasks} tasks reloaded the snapshot; snapshots sent {total.sent / 2**20:.0f} MB "
        f"of filters to Redis; a new worker reads "
        f"{new_bytes / 1024:.0f} KB in {new_ms:.0f} ms at open"
    )
    return {"entries": n, "bytes": size, "peak": peak, "stale": total.stale, "tried": tried}


def _result(done: Any, procs: list[Any]) -> dict[str, int]:
    """The next finished task's counters (a dead worker is an error, not a hang)."""
    while True:
        with contextlib.suppress(queue.Empty):
            counters: dict[str, int] = done.get(timeout=5)
            return counters
        dead = [p for p in procs if not p.is_alive()]
        if dead:
            raise SystemExit(f"a worker died (exit code {dead[0].exitcode}); see its output above")


def _line(ns: Namespace, batch: int, text: str, w: Window) -> None:
    n, size, snap, snap_seq, seq = ns.journal()
    new_bytes, new_ms, new_entries = ns.new_worker_open(batch, text)
    tasks = max(1, w.tasks)
    print(
        f"{batch + 1:>6}{seq:>9}{n:>9}{size / 1024:>8.0f}{snap / 1024:>9.0f}{seq - snap_seq:>8}"
        f"{w.snapshots:>7}{w.stale:>7}{w.sent / 2**20:>9.0f}"
        f"{w.entries / tasks:>14.1f}{w.reloads:>9}"
        f"{w.catch_up_us / tasks / 1e3:>13.2f}{new_bytes / 1024:>15.0f}{new_ms:>8.0f}"
        f"{new_entries:>9}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--partitions", default="2,4")
    parser.add_argument("--workers", type=int, default=0, help="0: one per partition")
    parser.add_argument("--batches", type=int, default=3600)
    parser.add_argument("--events", type=int, default=250, help="per partition and batch")
    parser.add_argument("--every", type=int, default=300, help="batches between lines")
    parser.add_argument("--chunk", type=int, default=2500, help="records per commit")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        redis_url = os.environ.get("REDIS_URL") or stack.enter_context(LocalRedis()).url
        for partitions in (int(p) for p in args.partitions.split(",")):
            run(partitions, args.workers or partitions, args, redis_url)


if __name__ == "__main__":
    main()
