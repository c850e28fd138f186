"""Streaming runs: a Spark Structured Streaming query that runs the plan once per micro-batch.

The sources' streaming DataFrames are unioned into one query (Spark keeps their offsets in the
checkpoint). For each micro-batch, ``foreachBatch`` compiles the physical plan over the
batch's rows and runs it as one Spark job, with a guard per task:

* exactly-once (default): record IDs, upstream backup and Bloom/Redis dedup at every boundary,
  keyed state in Redis committed atomically with the seen-marks (see ``dedup.guard``);
* at-least-once: keyed state in Redis, nothing else (the benchmark's baseline).

Spark calls ``foreachBatch`` for batch *n* only after batch *n - 1* is in its commit log, so
at the start of batch *n* every backup of batches before *n* is acknowledged (garbage for
``onceflow gc``). A driver takes a new fencing epoch when it starts: tasks of an older driver
can no longer commit.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from backup.store import acknowledge
from connectors.files import JsonLinesSink
from connectors.kafka import KafkaDeadLetterSink, KafkaSource
from dedup.config import DedupConfig
from dedup.errors import FencedError
from dedup.guard import AtLeastOnceGuards, ExactlyOnceGuards
from graph_optimizer.compile.body import Mode
from graph_optimizer.compile.metrics import CounterParam
from graph_optimizer.compile.spark import compile_batch
from graph_optimizer.compile.task import trigger_crash
from onceflow.errors import ConfigError
from onceflow.keyspace import Keyspace
from onceflow.settings import RedisSettings, check_durable, redis_client
from pipeline.errors import RunError
from pipeline.runner import RunResult, _explain_failure, _sink_connectors
from pipeline.session import adopt, spark_session

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from graph_optimizer.plan import Plan
    from pipeline.api import Pipeline

GUARANTEES = ("exactly-once", "at-least-once")


@dataclass
class StreamingRun:
    """The state of one streaming run, shared with the ``foreachBatch`` callback."""

    pipeline: Pipeline
    plan: Plan
    spark: SparkSession
    mode: Mode
    guards: Any
    client: Any
    keyspace: Keyspace
    epoch: int
    parallelism: int
    dead_letters: Any
    metrics: Any
    progress: bool
    batches: int = 0
    last_batch: int = -1
    started: float = field(default_factory=time.monotonic)
    history: list[tuple[int, int, float]] = field(default_factory=list)  # batch, records, s

    def run_batch(self, df: DataFrame, batch_id: int) -> None:
        """One micro-batch: acknowledge the previous ones, then run the plan."""
        from pyspark.sql import functions as F  # noqa: N812

        if self.mode is Mode.EXACTLY_ONCE:
            self._check_epoch()
            if batch_id > 0:
                acknowledge(self.client, self.keyspace, batch_id - 1)
        before = dict(self.metrics.value)
        t0 = time.monotonic()
        frames = {
            node.name: df.where(F.col("src") == i).drop("src")
            for i, node in enumerate(self.plan.graph.sources())
        }
        compiled = compile_batch(
            self.plan,
            self.spark,
            frames,
            self.guards,
            batch=batch_id,
            parallelism=self.parallelism,
            dead_letters=self.dead_letters,
            metrics=self.metrics,
            on_error=self.pipeline.on_error,
            max_record_bytes=self.pipeline.max_record_bytes,
        )
        compiled.run()
        driver_crashpoint("batch_end", batch_id)
        seconds = time.monotonic() - t0
        self.batches += 1
        self.last_batch = batch_id
        self.history.append((batch_id, self._records_since(before), seconds))
        if self.progress:
            self._report(batch_id, before, seconds)

    def _records_since(self, before: dict[str, int]) -> int:
        after = self.metrics.value
        sources = {self.plan.stage_of[s.name] for s in self.plan.graph.sources()}
        return sum(after.get(f"{s}/in", 0) - before.get(f"{s}/in", 0) for s in sources)

    def _check_epoch(self) -> None:
        current = int(self.client.get(self.keyspace.epoch) or 0)
        if current != self.epoch:
            msg = (
                f"another driver of pipeline {self.pipeline.name!r} started (epoch {current}, "
                f"this one is {self.epoch}); this driver stops"
            )
            raise FencedError(msg)

    def _report(self, batch_id: int, before: dict[str, int], seconds: float) -> None:
        after = self.metrics.value
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        sources = {self.plan.stage_of[s.name] for s in self.plan.graph.sources()}
        records = sum(delta.get(f"{s}/in", 0) for s in sources)
        dups = sum(v for k, v in delta.items() if k.endswith("/duplicates_dropped"))
        dead = sum(v for k, v in delta.items() if k.endswith("/dead_letters"))
        replayed = sum(v for k, v in delta.items() if k.endswith("/replayed_outputs"))
        rate = records / seconds if seconds > 0 else 0.0
        again = f", {replayed:,} outputs replayed from backup" if replayed else ""
        print(
            f"[{self.pipeline.name}] batch {batch_id}: {records:,} records in, {dups:,} "
            f"duplicates dropped, {dead:,} dead letters{again}, {seconds:.1f} s "
            f"({rate:,.0f}/s)",
            file=sys.stderr,
            flush=True,
        )


def driver_crashpoint(point: str, batch: int) -> None:
    """Driver-side fault injection (see ``graph_optimizer.compile.task.crashpoint``)."""
    spec = os.environ.get("ONCEFLOW_CRASH")
    if not spec:
        return
    wanted = dict(item.split("=", 1) for item in spec.split(",") if "=" in item)
    if wanted.get("point") != point or wanted.get("batch", str(batch)) != str(batch):
        return
    trigger_crash(wanted.get("mode", "kill"), f"{point} driver b{batch}")


def run_streaming(
    pipeline: Pipeline,
    plan: Plan,
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
    stop_after_batches: int | None = None,
    timeout_seconds: float | None = None,
    dedup: DedupConfig | None = None,
) -> RunResult:
    """Run an unbounded pipeline as a streaming query.

    ``available_now`` processes what the topics hold at start, in capped micro-batches, then
    stops (tests, backfills); otherwise a micro-batch starts every ``trigger_seconds`` (1 s)
    until ``stop_after_batches`` or ``timeout_seconds`` or Ctrl-C. ``checkpoint`` (default
    ``<output_dir>/<pipeline>/checkpoint``) and the Redis namespace (default the pipeline's
    name) together identify the pipeline's progress: keep both to resume after a crash.
    """
    if guarantee not in GUARANTEES:
        msg = f"guarantee must be one of {', '.join(GUARANTEES)}, got {guarantee!r}"
        raise ConfigError(msg)
    _check_sources(plan)
    mode = Mode.EXACTLY_ONCE if guarantee == "exactly-once" else Mode.AT_LEAST_ONCE
    config = dedup or pipeline.dedup
    settings = RedisSettings.from_env(redis_url, **(redis_options or {}))
    client = redis_client(settings)
    check_durable(client, allow_non_durable_redis)
    keyspace = Keyspace(namespace or pipeline.name)
    _check_meta(client, keyspace, parallelism, config)
    spark = session or spark_session(master, app_name=pipeline.name, parallelism=parallelism)
    adopt(spark)
    dead = _dead_letters(pipeline, plan, output_dir)
    for node in plan.graph.sources():
        if max_records_per_batch is not None:
            node.connector.max_records_per_batch = max_records_per_batch
        node.connector.prepare(pipeline.name, True)
    sinks = _sink_connectors(plan, dead)
    for sink in sinks:
        sink.prepare(pipeline.name, True)
    epoch = int(client.incr(keyspace.epoch)) if mode is Mode.EXACTLY_ONCE else 0
    if mode is Mode.EXACTLY_ONCE:
        guards: Any = ExactlyOnceGuards(settings, keyspace.namespace, epoch, config)
    else:
        guards = AtLeastOnceGuards(settings, keyspace.namespace, config)
    state = StreamingRun(
        pipeline,
        plan,
        spark,
        mode,
        guards,
        client,
        keyspace,
        epoch,
        parallelism,
        dead,
        spark.sparkContext.accumulator({}, CounterParam()),
        progress,
    )
    ckpt = checkpoint or os.path.join(output_dir, pipeline.name, "checkpoint")
    query = _start_query(state, ckpt, available_now, trigger_seconds)
    _await(query, state, stop_after_batches, timeout_seconds)
    done = last_committed_batch(ckpt)
    if mode is Mode.EXACTLY_ONCE and done is not None:
        acknowledge(client, keyspace, done)
    if done is not None:
        _sources_committed(plan, ckpt, done)
    for sink in sinks:
        sink.finish()
    return RunResult(
        pipeline=pipeline.name,
        plan=plan,
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


def _check_sources(plan: Plan) -> None:
    for node in plan.graph.sources():
        if node.connector.bounded:
            msg = (
                f"source {node.name!r} ({node.connector.describe()}) is bounded; a streaming "
                "pipeline reads only streams (Kafka): run bounded pipelines separately"
            )
            raise ConfigError(msg)


def _check_meta(client: Any, keyspace: Keyspace, parallelism: int, config: DedupConfig) -> None:
    """Settings that must not change while state exists (partition and bucket layout)."""
    wanted = {
        "parallelism": str(parallelism),
        "bucket_ms": str(config.bucket_ms),
        "shards": str(config.shards),
    }
    for name, value in wanted.items():
        client.hsetnx(keyspace.meta, name, value)
    client.hset(keyspace.meta, "horizon_ms", str(config.horizon_ms))
    stored = {k.decode(): v.decode() for k, v in client.hgetall(keyspace.meta).items()}
    for name, value in wanted.items():
        if stored.get(name) != value:
            msg = (
                f"pipeline namespace {keyspace.namespace!r} was created with {name}="
                f"{stored.get(name)}, this run asks for {value}: keyed state and dedup history "
                f"depend on it. Keep {name}={stored.get(name)}, or start a new namespace"
            )
            raise ConfigError(msg)


def _dead_letters(pipeline: Pipeline, plan: Plan, output_dir: str) -> Any:
    if pipeline.dead_letters is not None:
        return pipeline.dead_letters
    for node in plan.graph.sources():
        if isinstance(node.connector, KafkaSource):
            return KafkaDeadLetterSink(
                f"{pipeline.name}.dead-letters",
                bootstrap_servers=node.connector.settings.bootstrap_servers,
                options=node.connector.settings.options,
            )
    return JsonLinesSink(os.path.join(output_dir, pipeline.name, "dead-letters"))


def _start_query(
    state: StreamingRun, checkpoint: str, available_now: bool, trigger_seconds: float | None
) -> Any:
    from pyspark.sql import functions as F  # noqa: N812

    frames = []
    for i, node in enumerate(state.plan.graph.sources()):
        df = node.connector.stream(state.spark, state.pipeline.name, node.name)
        frames.append(df.withColumn("src", F.lit(i)))
    union = frames[0]
    for df in frames[1:]:
        union = union.unionByName(df)
    writer = (
        union.writeStream.foreachBatch(state.run_batch)
        .option("checkpointLocation", checkpoint)
        .queryName(f"onceflow-{state.pipeline.name}-{uuid.uuid4().hex[:6]}")
    )
    if available_now:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{trigger_seconds or 1.0} seconds")
    return writer.start()


def _await(query: Any, state: StreamingRun, stop_after: int | None, timeout: float | None) -> None:
    deadline = time.monotonic() + timeout if timeout else None
    try:
        while query.isActive:
            if query.awaitTermination(0.5):
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
            msg = f"pipeline {state.pipeline.name!r} was fenced: {text[:500]}"
            raise RunError(msg)
        raise RunError(_explain_failure(state.pipeline.name, Exception(text)))


def _sources_committed(plan: Plan, checkpoint: str, batch: int) -> None:
    """Tell each source where the last committed batch ended (Spark's offset log)."""
    path = os.path.join(checkpoint, "offsets", str(batch))
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()[2:]  # version, metadata, then one line per source
    except OSError:
        return
    for node, line in zip(plan.graph.sources(), lines, strict=False):
        try:
            offsets = json.loads(line)
        except ValueError:
            continue
        node.connector.committed(offsets)


def last_committed_batch(checkpoint: str) -> int | None:
    """The newest micro-batch in the checkpoint's commit log (local checkpoints only)."""
    commits = os.path.join(checkpoint, "commits")
    if not os.path.isdir(commits):
        return None
    found = [int(f) for f in os.listdir(commits) if f.isdigit()]
    return max(found) if found else None
