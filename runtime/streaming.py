"""Streaming runs: a Spark Structured Streaming query that runs the job once per micro-batch.

The sources' streaming DataFrames are unioned into one query (Spark keeps their offsets in the
checkpoint). For each micro-batch, ``foreachBatch`` compiles the job over the batch's rows and
runs it as one Spark job, with a guard per task:

* exactly-once (default): record IDs, upstream backup and Bloom/Redis dedup at every boundary,
  keyed state in Redis committed atomically with the seen-marks (see ``onceflow.dedup``);
* at-least-once: keyed state in Redis, nothing else (the benchmark's baseline).

Spark calls ``foreachBatch`` for batch *n* only after batch *n - 1* is in its commit log, so
at the start of batch *n* every backup of batches before *n* is acknowledged (garbage for
``onceflow gc``). A driver takes a new fencing epoch when it starts: tasks of an older driver
can no longer commit. The pipeline's settings that its state depends on (parallelism, bucket
layout, the physical plan) are pinned in Redis on the first run and checked on every start.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from onceflow.backup.store import acknowledge
from onceflow.connectors.files import JsonLinesSink
from onceflow.connectors.kafka import KafkaDeadLetterSink, KafkaSource
from onceflow.dedup.config import DedupConfig
from onceflow.dedup.errors import FencedError
from onceflow.dedup.guard import ExactlyOnceGuards
from onceflow.kernel.errors import ConfigError
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.records import Guarantee
from onceflow.kernel.settings import RedisSettings, check_durable, redis_client
from onceflow.runtime.bounded import all_sinks
from onceflow.runtime.errors import RunError
from onceflow.runtime.faults import driver_crashpoint
from onceflow.runtime.guard import AtLeastOnceGuards
from onceflow.runtime.metrics import CounterParam
from onceflow.runtime.pinning import pin_plan, pin_settings
from onceflow.runtime.result import RunResult, explain_failure
from onceflow.runtime.session import adopt, spark_session
from onceflow.runtime.shipping import ship_code
from onceflow.runtime.spark import compile_batch
from onceflow.runtime.spec import Job

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

GUARANTEES = ("exactly-once", "at-least-once")
DEFAULT_TRIGGER_SECONDS = 1.0
AWAIT_STEP_SECONDS = 0.5


@dataclass
class StreamingRun:
    """The state of one streaming run, shared with the ``foreachBatch`` callback."""

    job: Job
    spark: SparkSession
    mode: Guarantee
    guards: Any
    client: Any
    keyspace: Keyspace
    epoch: int
    parallelism: int
    metrics: Any
    progress: bool
    batches: int = 0
    last_batch: int = -1
    started: float = field(default_factory=time.monotonic)
    history: list[tuple[int, int, float]] = field(default_factory=list)  # batch, records, s

    def run_batch(self, df: DataFrame, batch_id: int) -> None:
        """One micro-batch: acknowledge the previous ones, then run the job."""
        from pyspark.sql import functions as F  # noqa: N812

        if self.mode is Guarantee.EXACTLY_ONCE:
            self._check_epoch()
            if batch_id > 0:
                acknowledge(self.client, self.keyspace, batch_id - 1)
        before = dict(self.metrics.value)
        t0 = time.monotonic()
        frames = {
            name: df.where(F.col("src") == i).drop("src")
            for i, (name, _) in enumerate(self.job.sources)
        }
        compiled = compile_batch(
            self.job,
            self.spark,
            frames,
            self.guards,
            batch=batch_id,
            parallelism=self.parallelism,
            metrics=self.metrics,
        )
        compiled.run()
        driver_crashpoint("batch_end", batch_id)
        seconds = time.monotonic() - t0
        self.batches += 1
        self.last_batch = batch_id
        delta = _delta(before, self.metrics.value)
        records = sum(delta.get(f"{s}/in", 0) for s in self.job.source_stages)
        self.history.append((batch_id, records, seconds))
        if self.progress:
            self._report(batch_id, records, delta, seconds)

    def _check_epoch(self) -> None:
        current = int(self.client.get(self.keyspace.epoch) or 0)
        if current != self.epoch:
            msg = (
                f"another driver of pipeline {self.job.pipeline!r} started (epoch {current}, "
                f"this one is {self.epoch}); this driver stops"
            )
            raise FencedError(msg)

    def _report(self, batch_id: int, records: int, delta: dict[str, int], seconds: float) -> None:
        dups = sum(v for k, v in delta.items() if k.endswith("/duplicates_dropped"))
        dead = sum(v for k, v in delta.items() if k.endswith("/dead_letters"))
        replayed = sum(v for k, v in delta.items() if k.endswith("/replayed_outputs"))
        rate = records / seconds if seconds > 0 else 0.0
        again = f", {replayed:,} outputs replayed from backup" if replayed else ""
        print(
            f"[{self.job.pipeline}] batch {batch_id}: {records:,} records in, {dups:,} "
            f"duplicates dropped, {dead:,} dead letters{again}, {seconds:.1f} s "
            f"({rate:,.0f}/s)",
            file=sys.stderr,
            flush=True,
        )


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}


def run_streaming(
    job: Job,
    *,
    master: str = "local[2]",
    parallelism: int = 2,
    progress: bool = True,
    session: SparkSession | None = None,
    output_dir: str = "onceflow-output",
    redis_url: str | None = None,
    redis_options: dict[str, Any] | None = None,
    namespace: str | None = None,
    checkpoint: str | None = None,
    guarantee: str = "exactly-once",
    trigger_seconds: float | None = None,
    available_now: bool = False,
    max_records_per_batch: int | None = None,
    allow_non_durable_redis: bool = False,
    accept_plan_change: bool = False,
    stop_after_batches: int | None = None,
    timeout_seconds: float | None = None,
    dedup: DedupConfig | None = None,
    code_dir: str | None = None,
) -> RunResult:
    """Run an unbounded job as a streaming query.

    ``available_now`` processes what the topics hold at start, in capped micro-batches, then
    stops (tests, backfills); otherwise a micro-batch starts every ``trigger_seconds`` (1 s)
    until ``stop_after_batches`` or ``timeout_seconds`` or Ctrl-C. ``checkpoint`` (default
    ``<output_dir>/<pipeline>/checkpoint``) and the Redis namespace (default the pipeline's
    name) together identify the pipeline's progress: keep both to resume after a crash.
    ``accept_plan_change`` resumes a namespace whose stored plan differs from this one
    (the dedup history of stages whose names changed starts over).
    """
    if guarantee not in GUARANTEES:
        msg = f"guarantee must be one of {', '.join(GUARANTEES)}, got {guarantee!r}"
        raise ConfigError(msg)
    _check_sources(job)
    mode = Guarantee.EXACTLY_ONCE if guarantee == "exactly-once" else Guarantee.AT_LEAST_ONCE
    config = dedup or job.dedup or DedupConfig()
    settings = RedisSettings.from_env(redis_url, **(redis_options or {}))
    client = redis_client(settings)
    check_durable(client, allow_non_durable_redis)
    keyspace = Keyspace(namespace or job.pipeline)
    pin_settings(client, keyspace, parallelism, config)
    pin_plan(client, keyspace, job, parallelism, accept_plan_change)
    spark = session or spark_session(master, app_name=job.pipeline, parallelism=parallelism)
    adopt(spark)
    if code_dir is not None:
        ship_code(spark, code_dir)
    dead = _dead_letters(job, output_dir)
    job = job.with_dead_letters(dead)
    for _, connector in job.sources:
        if max_records_per_batch is not None:
            connector.max_records_per_batch = max_records_per_batch
        connector.prepare(job.pipeline, True)
    sinks = all_sinks(job, dead)
    for sink in sinks:
        sink.prepare(job.pipeline, True)
    epoch = int(client.incr(keyspace.epoch)) if mode is Guarantee.EXACTLY_ONCE else 0
    if mode is Guarantee.EXACTLY_ONCE:
        guards: Any = ExactlyOnceGuards(settings, keyspace.namespace, epoch, config)
    else:
        guards = AtLeastOnceGuards(settings, keyspace.namespace, config)
    state = StreamingRun(
        job,
        spark,
        mode,
        guards,
        client,
        keyspace,
        epoch,
        parallelism,
        spark.sparkContext.accumulator({}, CounterParam()),
        progress,
    )
    ckpt = checkpoint or os.path.join(output_dir, job.pipeline, "checkpoint")
    query = _start_query(state, ckpt, available_now, trigger_seconds)
    _await(query, state, stop_after_batches, timeout_seconds)
    done = last_committed_batch(ckpt)
    if mode is Guarantee.EXACTLY_ONCE and done is not None:
        acknowledge(client, keyspace, done)
    if done is not None:
        _sources_committed(job, ckpt, done)
    for sink in sinks:
        sink.finish()
    return RunResult(
        pipeline=job.pipeline,
        job=job,
        mode=mode,
        seconds=time.monotonic() - state.started,
        counters=dict(state.metrics.value),
        dead_letter_sink=dead.describe(),
        batches=state.batches,
        extra={
            "epoch": epoch,
            "namespace": keyspace.namespace,
            "checkpoint": ckpt,
            "history": state.history,
        },
    )


def _check_sources(job: Job) -> None:
    for name, connector in job.sources:
        if connector.bounded:
            msg = (
                f"source {name!r} ({connector.describe()}) is bounded; a streaming "
                "pipeline reads only streams (Kafka): run bounded pipelines separately"
            )
            raise ConfigError(msg)


def _dead_letters(job: Job, output_dir: str) -> Any:
    if job.dead_letters is not None:
        return job.dead_letters
    for _, connector in job.sources:
        if isinstance(connector, KafkaSource):
            return KafkaDeadLetterSink(
                f"{job.pipeline}.dead-letters",
                bootstrap_servers=connector.settings.bootstrap_servers,
                options=connector.settings.options,
            )
    return JsonLinesSink(os.path.join(output_dir, job.pipeline, "dead-letters"))


def _start_query(
    state: StreamingRun, checkpoint: str, available_now: bool, trigger_seconds: float | None
) -> Any:
    from pyspark.sql import functions as F  # noqa: N812

    frames = []
    for i, (name, connector) in enumerate(state.job.sources):
        df = connector.stream(state.spark, state.job.pipeline, name)
        frames.append(df.withColumn("src", F.lit(i)))
    union = frames[0]
    for df in frames[1:]:
        union = union.unionByName(df)
    writer = (
        union.writeStream.foreachBatch(state.run_batch)
        .option("checkpointLocation", checkpoint)
        .queryName(f"onceflow-{state.job.pipeline}-{uuid.uuid4().hex[:6]}")
    )
    if available_now:
        writer = writer.trigger(availableNow=True)
    else:
        seconds = trigger_seconds or DEFAULT_TRIGGER_SECONDS
        writer = writer.trigger(processingTime=f"{seconds} seconds")
    return writer.start()


def _await(query: Any, state: StreamingRun, stop_after: int | None, timeout: float | None) -> None:
    deadline = time.monotonic() + timeout if timeout else None
    try:
        while query.isActive:
            if query.awaitTermination(AWAIT_STEP_SECONDS):
                break
            if stop_after is not None and state.batches >= stop_after:
                query.stop()
                break
            if deadline is not None and time.monotonic() > deadline:
                query.stop()
                break
    except KeyboardInterrupt:
        query.stop()
        raise
    error = query.exception()
    if error is not None:
        text = str(error)
        if "FencedError" in text:
            msg = f"pipeline {state.job.pipeline!r} was fenced: {text[:500]}"
            raise RunError(msg)
        raise RunError(explain_failure(state.job.pipeline, Exception(text)))


def _sources_committed(job: Job, checkpoint: str, batch: int) -> None:
    """Tell each source where the last committed batch ended (Spark's offset log)."""
    path = os.path.join(checkpoint, "offsets", str(batch))
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()[2:]  # version, metadata, then one line per source
    except OSError:
        return
    for (_, connector), line in zip(job.sources, lines, strict=False):
        try:
            offsets = json.loads(line)
        except ValueError:
            continue
        connector.committed(offsets)


def last_committed_batch(checkpoint: str) -> int | None:
    """The newest micro-batch in the checkpoint's commit log (local checkpoints only)."""
    commits = os.path.join(checkpoint, "commits")
    if not os.path.isdir(commits):
        return None
    found = [int(f) for f in os.listdir(commits) if f.isdigit()]
    return max(found) if found else None
