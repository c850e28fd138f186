"""Where a task's CPU goes, without Spark: the benchmark's stages run in this process.

``bench/exactly_once.py`` measures whole queries: Spark, the JVM, the Kafka reader, Python
workers and the broker share two cores, and runs vary by 5-10%. This runs only what Onceflow
adds: the task loop of each stage of a workload (:class:`onceflow.runtime.task.loop.StageFunction`,
the function ``mapInArrow`` calls) over the raw rows the Kafka reader hands Spark, in this
process, with a real Redis and a real broker, for each mode one after the other. It prints the
CPU microseconds per input record of this process (task loop, Redis client, Kafka producer),
of the Redis server and of the broker, and with ``--profile N`` the N functions whose own
time grows most from at-least-once to exactly-once (cProfile). Repeated runs agree within a
few percent, so a change of a few percent shows.

Stages run one micro-batch at a time: the source stage over every input record of the batch
as one task (one Kafka partition), then each exchange stage as one task over all its rows
(parallelism 1). Spark's own costs (the reader, Arrow transfers, scheduling) are not here.

    python bench/stage_loop.py [--records 200000] [--batch 50000] [--repeat 3]
        [--workloads stateless,keyed-count,keyed-count-ids] [--profile 25]
        [--client auto|python|confluent] [--calls]

``--calls`` adds a column: Python function calls (and calls into C) per record of the thread
running the tasks, counted with ``sys.setprofile`` in a run of its own: unlike CPU times it
does not move with the machine's load, so it shows a change of the hot path on a busy machine.

Uses REDIS_URL / KAFKA_BOOTSTRAP_SERVERS when set, else starts local ones.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

sys.path.insert(0, os.path.dirname(__file__))
from exactly_once import (  # noqa: E402 - the benchmark's workloads and services
    BROKER_PID_ENV,
    EVENT_START_MS,
    EVENT_STEP_MS,
    MODES,
    _cpu_seconds,
    build,
    services,
)

from onceflow.connectors.kafka.worker import RAW_COLUMNS  # noqa: E402
from onceflow.dedup.batch import fix_batch_params  # noqa: E402
from onceflow.dedup.config import DedupConfig  # noqa: E402
from onceflow.dedup.guard import ExactlyOnceGuards  # noqa: E402
from onceflow.kernel.eventtime import EventTime  # noqa: E402
from onceflow.kernel.keyspace import Keyspace  # noqa: E402
from onceflow.kernel.scopes import pin_scopes, raise_epochs  # noqa: E402
from onceflow.kernel.settings import RedisSettings, redis_client  # noqa: E402
from onceflow.runtime.driver.pinning import pin_settings  # noqa: E402
from onceflow.runtime.driver.startup import streaming_dead_letters  # noqa: E402
from onceflow.runtime.guard import AtLeastOnceGuards  # noqa: E402
from onceflow.runtime.spec import Job  # noqa: E402
from onceflow.runtime.task.loop import StageFunction  # noqa: E402

WORKLOADS = ("stateless", "keyed-count", "keyed-count-ids", "sliding-window", "fan-out")
READ_BATCH = 10_000  # rows per Arrow batch, as the Kafka reader hands them over


def raw_batches(topic: str, first: int, count: int) -> list[pa.RecordBatch]:
    """The raw rows of bids ``first .. first + count`` of one Kafka partition."""
    rng = random.Random(first)
    out = []
    for lo in range(first, first + count, READ_BATCH):
        hi = min(first + count, lo + READ_BATCH)
        values = [
            json.dumps(
                {
                    "user": f"u{rng.randrange(1000)}",
                    "auction": rng.randrange(100),
                    "price": rng.randrange(1, 10_000),
                    "ts": EVENT_START_MS + i * EVENT_STEP_MS,
                    "n": i,
                }
            ).encode()
            for i in range(lo, hi)
        ]
        n = hi - lo
        out.append(
            pa.RecordBatch.from_arrays(
                [
                    pa.array([topic] * n, pa.string()),
                    pa.array([0] * n, pa.int32()),
                    pa.array(range(lo, hi), pa.int64()),
                    pa.array([EVENT_START_MS + i * EVENT_STEP_MS for i in range(lo, hi)]),
                    pa.array([None] * n, pa.binary()),
                    pa.array(values, pa.binary()),
                    pa.array([None] * n, pa.binary()),
                ],
                names=list(RAW_COLUMNS),
            )
        )
    return out


def prepared_job(workload: str, mode: str, bootstrap: str, client: str = "auto") -> Job:
    """The workload's job with its dead-letter sink, every sink prepared for streaming."""
    _guarantee, transactional = MODES[mode]
    name = f"loop-{mode[:2]}-{uuid.uuid4().hex[:6]}"
    os.environ["KAFKA_BOOTSTRAP_SERVERS"] = bootstrap
    pipeline = build(workload, name, f"{name}-in", f"{name}-out", transactional, client)
    job = pipeline.job()
    job = job.with_dead_letters(streaming_dead_letters(job, "/tmp"))
    for stage in job.stages:
        for target in stage.targets:
            if not target.is_row:
                target.connector.prepare(job.pipeline, True)
    return job


class Namespace:
    """A pipeline namespace in Redis and the guards of each micro-batch, as a run sets them."""

    def __init__(self, redis_url: str, job: Job, mode: str) -> None:
        self.settings = RedisSettings(redis_url)
        self.ks = Keyspace(job.pipeline)
        self.client = redis_client(self.settings, self.ks.namespace)
        self.config = DedupConfig()
        pin_settings(self.client, self.ks, 1, self.config)
        exchanges = [s.name for s in job.stages if s.exchange]
        stages = [s.name for s in job.stages]
        scopes = pin_scopes(self.client, self.ks, exchanges, stages, frozenset(), 1, True)
        self.epoch = int(self.client.incr(self.ks.epoch))
        raise_epochs(scopes, self.epoch, lambda tag: redis_client(self.settings, tag))
        guarantee, _ = MODES[mode]
        if guarantee == "exactly-once":
            self.guards: Any = ExactlyOnceGuards(
                self.settings, self.ks.namespace, self.epoch, self.config, scoped=scopes.stages
            )
        else:
            self.guards = AtLeastOnceGuards(
                self.settings, self.ks.namespace, self.config, scoped=scopes.stages
            )

    def for_batch(self, batch: int) -> Any:
        params = fix_batch_params(
            self.client, self.ks, self.epoch, batch, self.config, EventTime.of("1s")
        )
        return self.guards.for_batch(params)


def run_batch(job: Job, ns: Namespace, batch: int, raw: list[pa.RecordBatch]) -> int:
    """Every stage of one micro-batch; returns the rows the last stages sent on."""
    guards = ns.for_batch(batch)
    outputs: dict[str, list[pa.RecordBatch]] = {}
    sent = 0
    for spec in job.stages:
        if spec.source is not None:
            inputs: Iterator[pa.RecordBatch] = iter(raw)
        else:
            inputs = iter(_inbound_rows(spec, outputs))
        fn = StageFunction(spec, guards, batch, None, 1 if spec.exchange else None)
        outputs[spec.name] = list(fn(inputs))
        sent += sum(b.num_rows for b in outputs[spec.name])
    return sent


def _inbound_rows(spec: Any, outputs: dict[str, list[pa.RecordBatch]]) -> list[pa.RecordBatch]:
    """What the compiler's ``where(port == p)`` and relabelling give a stage (one partition)."""
    import pyarrow.compute as pc

    rows = []
    for inbound in spec.inbound:
        for b in outputs[inbound.producer]:
            part = b.filter(pc.equal(b.column("port"), inbound.port))
            if part.num_rows:
                ports = pa.array([inbound.index] * part.num_rows, pa.int32())
                rows.append(part.set_column(4, "port", ports))
    return rows


class CallCounter:
    """Python function calls and calls into C (``sys.setprofile`` events) of this thread.

    What a record costs in calls does not depend on how loaded the machine is: a change that
    makes the hot path shorter shows here even when CPU times are noisy. Threads other than
    the one running the tasks (kafka-python's sender, librdkafka's own) are not counted.
    """

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, _frame: Any, event: str, _arg: Any) -> None:
        if event == "call" or event == "c_call":
            self.calls += 1


def measure(
    workload: str,
    mode: str,
    args: argparse.Namespace,
    redis_url: str,
    bootstrap: str,
    count_calls: bool = False,
) -> dict[str, Any]:
    """One run of ``args.records`` records in batches; CPU per record by process.

    ``count_calls``: count Python calls per record instead (slower, so a run of its own).
    """
    job = prepared_job(workload, mode, bootstrap, args.client)
    ns = Namespace(redis_url, job, mode)
    topic = job.sources[0][1].topics[0]
    warm = 2000  # a first batch warms clients and filters (its events come first in time)
    batches = [
        raw_batches(topic, warm + lo, min(args.batch, args.records - lo))
        for lo in range(0, args.records, args.batch)
    ]
    run_batch(job, ns, 0, raw_batches(topic, 0, warm))
    broker_pid = int(os.environ.get(BROKER_PID_ENV, "0"))
    redis_before = _redis_cpu(ns.client)
    broker_before = _cpu_seconds(broker_pid) if broker_pid else None
    profile = cProfile.Profile() if args.profile and not count_calls else None
    counter = CallCounter() if count_calls else None
    cpu0, wall0 = time.process_time(), time.perf_counter()
    if profile is not None:
        profile.enable()
    if counter is not None:
        sys.setprofile(counter)
    for n, raw in enumerate(batches, start=1):
        run_batch(job, ns, n, raw)
    sys.setprofile(None)
    if profile is not None:
        profile.disable()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    per = 1e6 / args.records
    broker_after = _cpu_seconds(broker_pid) if broker_pid else None
    return {
        "loop_us": cpu * per,
        "wall_us": wall * per,
        "redis_us": (_redis_cpu(ns.client) - redis_before) * per,
        "broker_us": (broker_after - broker_before) * per
        if broker_before is not None and broker_after is not None
        else float("nan"),
        "profile": profile,
        "calls": counter.calls / args.records if counter is not None else float("nan"),
    }


def _redis_cpu(client: Any) -> float:
    cpu = client.info("cpu")
    return float(cpu["used_cpu_user_main_thread"]) + float(cpu["used_cpu_sys_main_thread"])


def own_times(profile: cProfile.Profile, records: int) -> dict[str, float]:
    """Own (not cumulative) µs per record of every function of a profile."""
    stats = pstats.Stats(profile)
    out = {}
    for (path, line, func), (_cc, _nc, tt, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        where = "/".join(path.split("/")[-2:])
        out[f"{func} ({where}:{line})"] = tt * 1e6 / records
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=50_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workloads", default="stateless,keyed-count,keyed-count-ids")
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    parser.add_argument(
        "--calls",
        action="store_true",
        help="also count Python calls per record (one more run per mode; independent of load)",
    )
    parser.add_argument(
        "--client",
        default="auto",
        help="Kafka client of the sinks: auto (confluent-kafka when installed), python, confluent",
    )
    args = parser.parse_args()
    with services(False) as (redis_url, bootstrap, _cluster):
        for workload in args.workloads.split(","):
            if workload not in WORKLOADS:
                parser.error(f"unknown workload {workload!r}")
            report(workload, args, redis_url, bootstrap)


def report(workload: str, args: argparse.Namespace, redis_url: str, bootstrap: str) -> None:
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for _ in range(args.repeat):
        for mode in MODES:
            runs[mode].append(measure(workload, mode, args, redis_url, bootstrap))
    calls = {
        mode: measure(workload, mode, args, redis_url, bootstrap, count_calls=True)["calls"]
        for mode in (MODES if args.calls else ())
    }
    print(
        f"\n--- {workload}: {args.records:,} records, {args.batch:,} per batch, CPU µs per record"
    )
    head = f"{'mode':<26}{'task loops':>22}{'Redis':>8}{'broker':>8}{'total':>8}{'wall':>8}"
    print(head + (f"{'calls':>8}" if calls else ""))
    totals = {}
    for mode, rs in runs.items():
        loop = [r["loop_us"] for r in rs]
        med = {k: statistics.median(r[k] for r in rs) for k in ("redis_us", "broker_us", "wall_us")}
        totals[mode] = statistics.median(loop) + med["redis_us"] + med["broker_us"]
        print(
            f"{mode:<26}{statistics.median(loop):>8.2f} ({min(loop):.2f}..{max(loop):.2f})"
            f"{med['redis_us']:>8.2f}{med['broker_us']:>8.2f}{totals[mode]:>8.2f}"
            f"{med['wall_us']:>8.2f}" + (f"{calls[mode]:>8.1f}" if calls else "")
        )
    base = totals["at-least-once"]
    for mode in ("exactly-once/plain-sink", "exactly-once"):
        print(f"  {mode} adds {totals[mode] - base:.2f} µs per record to at-least-once's")
    if args.profile:
        print_growth(runs, args)


def print_growth(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    """Functions whose own time grows most from at-least-once to exactly-once (last runs)."""
    alo = own_times(runs["at-least-once"][-1]["profile"], args.records)
    eo = own_times(runs["exactly-once"][-1]["profile"], args.records)
    growth = sorted(((eo.get(f, 0) - alo.get(f, 0), f) for f in set(alo) | set(eo)), reverse=True)
    print(f"\n  own µs per record, at-least-once -> exactly-once (top {args.profile} by growth)")
    for delta, func in growth[: args.profile]:
        print(f"  {alo.get(func, 0):8.3f} {eo.get(func, 0):8.3f}  {delta:+8.3f}  {func[:90]}")
    top = sorted(alo.items(), key=lambda kv: -kv[1])[: args.profile]
    print(f"\n  own µs per record in at-least-once (top {args.profile})")
    for func, us in top:
        print(f"  {us:8.3f}  {func[:90]}")
    calls = call_counts(runs["exactly-once"][-1]["profile"], args.records)
    print(f"\n  calls per record in exactly-once (top {args.profile})")
    for func, n in sorted(calls.items(), key=lambda kv: -kv[1])[: args.profile]:
        print(f"  {n:8.2f}  {func[:90]}")


def call_counts(profile: cProfile.Profile, records: int) -> dict[str, float]:
    """Calls per record of every function of a profile (where the hot path's calls go)."""
    stats = pstats.Stats(profile)
    out = {}
    for (path, line, func), (_cc, nc, _tt, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        out[f"{func} ({'/'.join(path.split('/')[-2:])}:{line})"] = nc / records
    return out


if __name__ == "__main__":
    main()
