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

import logging
import os
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from onceflow.backup.store import acknowledge
from onceflow.connectors.files import JsonLinesSink
from onceflow.connectors.kafka import KafkaDeadLetterSink, KafkaSource
from onceflow.connectors.kafka.clients import CONFLUENT_CLIENT, PYTHON_CLIENT
from onceflow.connectors.kafka.offsets import flat_offsets, split_tp
from onceflow.connectors.kafka.spark_source import session_conf
from onceflow.dedup.batch import fix_batch_params
from onceflow.dedup.clock import BatchClock
from onceflow.dedup.config import DedupConfig
from onceflow.dedup.durability import (
    DEFAULT_TIMEOUT_MS,
    BatchDurability,
    Durability,
    check_markers,
    plan_durability,
    settle_aof,
    wait_durable,
)
from onceflow.dedup.errors import FencedError, ServerChangedError, server_changed_message
from onceflow.dedup.guard import ExactlyOnceGuards
from onceflow.kernel.errors import ConfigError
from onceflow.kernel.eventtime import EventTime
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.records import Guarantee
from onceflow.kernel.scopes import (
    Connect,
    Scopes,
    distinct,
    merge_generations,
    pin_scopes,
    raise_epochs,
    stored_stages,
)
from onceflow.kernel.settings import RedisSettings, check_durable, redis_client
from onceflow.runtime.bounded import prepare_sinks
from onceflow.runtime.checkpoint import Checkpoint, choose_manager
from onceflow.runtime.errors import RunError
from onceflow.runtime.faults import CrashPoint, driver_crashpoint
from onceflow.runtime.guard import AtLeastOnceGuards
from onceflow.runtime.heartbeat import DriverHeartbeat, driver_info
from onceflow.runtime.metrics import CounterParam
from onceflow.runtime.pinning import check_not_behind, pin_checkpoint, pin_plan, pin_settings
from onceflow.runtime.placement import check_paths
from onceflow.runtime.result import RunResult, explain_failure
from onceflow.runtime.run_config import DEFAULT_REDIS_RESTARTS, DEFAULT_TRIGGER_SECONDS, RunConfig
from onceflow.runtime.session import (
    adopt,
    default_log_file,
    log_file,
    spark_session,
    warm_workers,
)
from onceflow.runtime.shipping import ship_code
from onceflow.runtime.spark import StreamCompiler
from onceflow.runtime.spec import Job
from onceflow.runtime.stopping import (
    STOP_MARK,
    SignalHandlers,
    StopRequest,
    StopRequested,
    stop_on_signals,
)
from onceflow.runtime.ticks import Ticker

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

AWAIT_STEP_SECONDS = 0.5

log = logging.getLogger(__name__)


class Phases:
    """Where a step's time went: seconds per named phase, and Spark jobs and stages."""

    def __init__(self, start: float | None = None) -> None:
        self.last = time.monotonic() if start is None else start
        self.seconds: dict[str, float] = {}
        self.jobs = self.stages = 0

    def mark(self, name: str) -> None:
        """The phase ``name`` ended now."""
        now = time.monotonic()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self.last
        self.last = now

    def count_jobs(self, spark: Any, group: str) -> None:
        """Spark jobs and stages of a job group (monitoring only: never fails a batch)."""
        try:
            tracker = spark.sparkContext.statusTracker()
            jobs = tracker.getJobIdsForGroup(group)
            self.jobs = len(jobs)
            infos = [tracker.getJobInfo(j) for j in jobs]
            self.stages = sum(len(i.stageIds) for i in infos if i is not None)
        except Exception as exc:  # noqa: BLE001
            log.debug("no job count for %s: %s", group, exc)

    def describe(self) -> str:
        """``plan 0.05 s, spark 0.61 s, ...; 1 Spark job(s), 3 stage(s)``."""
        parts = ", ".join(f"{k} {v:.3f} s" for k, v in self.seconds.items())
        return f"{parts}; {self.jobs} Spark job(s), {self.stages} stage(s)"


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
    config: DedupConfig = field(default_factory=DedupConfig)
    durability: Durability | None = None
    ticker: Ticker | None = None
    trigger_ms: int = 1000
    watermark: int = 0
    batches: int = 0
    last_batch: int = -1
    started: float = field(default_factory=time.monotonic)
    history: list[tuple[int, int, float]] = field(default_factory=list)  # batch, records, s
    stop: StopRequest = field(default_factory=StopRequest)
    stop_after: int | None = None
    exporter: Any = None  # a RunExporter when metrics are served
    checkpoint: Checkpoint | None = None
    startup: dict[str, float] = field(default_factory=dict)  # start-up step -> seconds
    scopes: Scopes | None = None  # stage partitions with a hash tag of their own
    connect: Connect | None = None  # the client of a hash tag
    compiler: StreamCompiler | None = None  # made at the first micro-batch
    redis_restarts: int = DEFAULT_REDIS_RESTARTS  # runs of a batch again after a server change
    servers: dict[str, str] = field(default_factory=dict)  # tag -> run id at the last batch
    clock: BatchClock | None = None  # where new batches' times come from (dedup.clock)

    def targets(self) -> list[tuple[Keyspace, Any]]:
        """Every hash tag of the pipeline with its client, the namespace's first."""
        keyspaces = self.scopes.keyspaces() if self.scopes is not None else [self.keyspace]
        connect = self.connect or (lambda _tag: self.client)
        return [(ks, connect(ks.tag)) for ks in keyspaces]

    def run_batch(self, df: DataFrame, batch_id: int) -> None:
        """One micro-batch: acknowledge the previous ones, then run the job.

        After a stop request it refuses to start (see :mod:`.stopping`), doing nothing. A
        Redis server that restarted or failed over during the batch makes it run again, up to
        ``redis_restarts`` times (see :mod:`onceflow.dedup.durability`).
        """
        if self.stop.requested:
            log.info("batch %d not started (%s): the next run plans it", batch_id, self.stop.reason)
            raise StopRequested
        phases = Phases()
        if self.batches == 0:
            self._first_batch()
        self._check_epoch()
        if batch_id > 0 and self.mode is Guarantee.EXACTLY_ONCE:
            acknowledge(self.client, self.keyspace, batch_id - 1)
        before = dict(self.metrics.value)
        t0 = time.monotonic()
        again = 0
        while True:
            try:
                params = self._attempt(df, batch_id, phases)
                break
            except Exception as exc:
                if not _server_changed(exc) or again >= self.redis_restarts:
                    raise
                again += 1
                self._run_again(batch_id, exc, again)
        driver_crashpoint(CrashPoint.BATCH_END, batch_id)
        if self.ticker is not None:
            self.ticker.after_batch(self.trigger_ms)
        phases.mark("ticks")
        self._done(batch_id, time.monotonic() - t0, before, params, phases)

    def _attempt(self, df: DataFrame, batch_id: int, phases: Phases) -> Any:
        """Fix the batch's parameters, run its job, wait until its writes are durable."""
        targets = self.targets()
        this_batch = self._servers_now(targets, batch_id)
        server = this_batch.servers.get(self.keyspace.tag, "") if this_batch else ""
        params = fix_batch_params(
            self.client,
            self.keyspace,
            self.epoch,
            batch_id,
            self.config,
            self.job.event_time or EventTime(),
            server,
            self.clock,
        )
        self.watermark = params.watermark
        guards = self.guards.for_batch(params, this_batch)
        phases.mark("params")
        self._run_job(df, batch_id, guards, phases)
        if self.mode is Guarantee.EXACTLY_ONCE and self.scopes is not None and self.connect:
            if merge_generations(self.client, self.scopes, self.connect, server) < 0:
                raise ServerChangedError(server_changed_message("the namespace", batch_id))
        if self.durability is not None and this_batch is not None:
            wait_durable(targets, batch_id, self.durability, this_batch)
        phases.mark("durable")
        return params

    def _servers_now(
        self, targets: list[tuple[Keyspace, Any]], batch_id: int
    ) -> BatchDurability | None:
        """Each master's server now; if one changed since the last batch, it kept its writes.

        A server that restarted between two batches may have lost writes after the last
        batch's durable marker, which matter to nobody, or before it, which no rerun can redo
        (:func:`~onceflow.dedup.durability.check_markers` stops the run then).
        """
        if self.durability is None:
            return None
        this_batch = self.durability.for_batch([(ks.tag, c) for ks, c in targets])
        servers = dict(this_batch.servers)
        if self.servers and servers != self.servers:
            committed = batch_id - 1 if batch_id > 0 else None
            check_markers(targets, committed, self.keyspace.namespace)
        self.servers = servers
        return this_batch

    def _run_job(self, df: DataFrame, batch_id: int, guards: Any, phases: Phases) -> None:
        """Compile the batch's job over its rows and run it as one Spark job."""
        from pyspark.sql import functions as F  # noqa: N812

        if len(self.job.sources) == 1:  # no "src" column to tell sources apart
            frames = {self.job.sources[0][0]: df}
        else:
            frames = {
                name: df.where(F.col("src") == i).drop("src")
                for i, (name, _) in enumerate(self.job.sources)
            }
        if self.compiler is None:
            self.compiler = StreamCompiler(
                self.job, self.spark, self.guards, self.parallelism, self.metrics
            )
        compiled = self.compiler.compile(frames, guards, batch_id)
        phases.mark("plan")
        group = f"onceflow-batch-{batch_id}"
        self.spark.sparkContext.setJobGroup(group, f"{self.job.pipeline} micro-batch {batch_id}")
        compiled.run()
        phases.mark("spark")
        phases.count_jobs(self.spark, group)

    def _run_again(self, batch_id: int, exc: Exception, again: int) -> None:
        """Say that a batch runs again after its Redis server changed; log why."""
        log.warning("batch %d: the Redis server changed: %s", batch_id, exc)
        line = (
            f"Redis restarted or failed over during micro-batch {batch_id}: running it again "
            f"from what Redis kept ({again} of {self.redis_restarts})"
        )
        _say(self.job.pipeline, line)  # an incident, not progress: said even without it
        self.servers = {}  # the next attempt checks the markers against what Spark committed
        committed = batch_id - 1 if batch_id > 0 else None
        check_markers(self.targets(), committed, self.keyspace.namespace)

    def _done(
        self, batch_id: int, seconds: float, before: dict[str, int], params: Any, phases: Phases
    ) -> None:
        """A batch committed: history, log, metrics, progress, and a stop after N batches."""
        self.batches += 1
        self.last_batch = batch_id
        delta = _delta(before, self.metrics.value)
        records = sum(delta.get(f"{s}/in", 0) for s in self.job.source_stages)
        self.history.append((batch_id, records, seconds))
        log.info("batch %d: %d records in %.2f s; counters %s", batch_id, records, seconds, delta)
        log.info("batch %d phases: %s", batch_id, phases.describe())
        if self.exporter is not None:
            self._observe(batch_id, records, seconds, params)
        if self.progress:
            self._report(batch_id, records, delta, seconds)
        if self.stop_after is not None and self.batches >= self.stop_after:
            self.stop.request(f"stop after {self.stop_after} micro-batch(es)")

    def _first_batch(self) -> None:
        """Say once how long the run took to reach its first micro-batch, and where."""
        took = time.monotonic() - self.started
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in self.startup.items())
        line = f"first micro-batch starts {took:.1f} s after the run began ({parts})"
        log.info(line)
        if self.progress:
            _say(self.job.pipeline, line)

    def _observe(self, batch_id: int, records: int, seconds: float, params: Any) -> None:
        """Feed the metrics endpoint; monitoring never fails a batch."""
        from onceflow.runtime.exporter import BatchView

        gc_last: int | None = None
        try:
            raw = self.client.hget(self.keyspace.gc, "last_pass_ms")
            gc_last = int(raw) if raw is not None else None
        except Exception as exc:  # noqa: BLE001 - monitoring only
            log.warning("metrics: cannot read the GC record: %s", exc)
        view = BatchView(
            batch_id,
            seconds,
            records,
            dict(self.metrics.value),
            params,
            self._offsets(batch_id),
            gc_last,
        )
        self.exporter.observe(view)

    def _offsets(self, batch_id: int) -> dict[tuple[str, str, int], tuple[int, int | None]]:
        """Per source partition: where this batch ended, and where readable records end now."""
        if self.checkpoint is None:
            return {}
        out: dict[tuple[str, str, int], tuple[int, int | None]] = {}
        ends = self.checkpoint.end_offsets(batch_id)
        for (name, connector), value in zip(self.job.sources, ends, strict=False):
            probe = getattr(connector, "readable_ends", None)
            now: dict[str, int] = {}
            if probe is not None:
                try:
                    now = probe()
                except Exception as exc:  # noqa: BLE001 - monitoring only
                    log.warning("metrics: no readable offsets for source %r: %s", name, exc)
            for key, done in flat_offsets(value).items():
                topic, partition = split_tp(key)
                out[(name, topic, partition)] = (done, now.get(key))
        return out

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
        restamped = sum(v for k, v in delta.items() if "/restamped/" in k)
        rate = records / seconds if seconds > 0 else 0.0
        again = f", {replayed:,} outputs replayed from backup" if replayed else ""
        if restamped:
            again += f", {restamped:,} stamped with the time of writing"
        print(
            f"[{self.job.pipeline}] batch {batch_id}: {records:,} records in, {dups:,} "
            f"duplicates dropped, {dead:,} dead letters{again}, {seconds:.1f} s "
            f"({rate:,.0f}/s)",
            file=sys.stderr,
            flush=True,
        )


def _server_changed(exc: BaseException) -> bool:
    """Whether a batch failed because a Redis server changed (in the driver or a task)."""
    return isinstance(exc, ServerChangedError) or ServerChangedError.__name__ in str(exc)


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}


def checkpoint_location(given: str | None, output_dir: str, pipeline: str) -> str:
    """Where a query's checkpoint is: ``given``, else ``<output_dir>/<pipeline>/checkpoint``.

    A plain path is made absolute against the folder the run starts from, so the location is
    fixed before the query starts and printed as such; a URL (``file://``, ``hdfs://``,
    ``s3a://`` ...) is kept as it is. A run started from another folder therefore finds
    another (empty) checkpoint: :func:`~onceflow.runtime.pinning.pin_checkpoint` refuses it
    rather than re-reading input against the namespace's state.
    """
    location = given or os.path.join(output_dir, pipeline, "checkpoint")
    if "://" in location:
        return location
    return os.path.abspath(location)


def run_streaming(job: Job, opts: RunConfig, session: SparkSession | None = None) -> RunResult:
    """Run an unbounded job as a streaming query, with the settings of ``opts``.

    ``available_now`` processes what the topics hold at start, in capped micro-batches, then
    stops (tests, backfills); otherwise a micro-batch starts every ``trigger_seconds`` (1 s)
    until ``stop_after_batches`` or ``timeout_seconds``, or SIGTERM or SIGINT (Ctrl-C): each
    lets the micro-batch under way finish, then the run ends normally (see
    :mod:`.stopping`). ``checkpoint`` (default
    ``<output_dir>/<pipeline>/checkpoint``, made absolute) and the Redis namespace (default
    the pipeline's name) together identify the pipeline's progress: keep both to resume after
    a crash (a mismatch is refused). ``accept_plan_change`` resumes a namespace whose stored
    plan differs from this one (the dedup history of stages whose names changed starts
    over). At the end of every micro-batch the driver waits until its writes are durable (the
    AOF fsync where Redis can confirm it, and ``redis_wait_replicas`` replicas: by default
    one if Redis has any). ``metrics_port`` serves Prometheus metrics on ``metrics_host``
    (loopback by default; see :mod:`.exporter`), ``metrics_linger`` seconds past the run's
    end; ``spark_conf`` and ``log_level`` apply to the session the run starts.
    """
    stop = StopRequest()
    with stop_on_signals(stop, lambda line: _say(job.pipeline, line)) as handlers:
        return _run(job, session, opts, handlers)


def _say(pipeline: str, line: str) -> None:
    print(f"[{pipeline}] {line}", file=sys.stderr, flush=True)


def _run(
    job: Job, session: SparkSession | None, opts: RunConfig, handlers: SignalHandlers
) -> RunResult:
    began = time.monotonic()
    steps = Phases(began)
    stop = handlers.stop
    mode = opts.guarantee
    _check_sources(job)  # and wait for their systems (and the sinks'): see _connect
    config = opts.dedup or job.dedup or DedupConfig()
    redis = RedisSettings.from_env(opts.redis_url, **(opts.redis_options or {}))
    keyspace = Keyspace(opts.namespace or job.pipeline)
    client = redis_client(redis, keyspace.namespace)
    scopes, durability = _pin_namespace(job, opts, config, redis, client, keyspace)
    steps.mark("Redis")
    spark = session or spark_session(
        opts.master,
        app_name=job.pipeline,
        parallelism=opts.parallelism,
        log_path=default_log_file(job.pipeline, opts.output_dir),
        log_level=opts.log_level,
        extra_conf=_session_conf(job, opts.spark_conf),
    )
    handlers.install()  # over PySpark's SIGINT handler, set when its context started
    adopt(spark)
    warm_workers(spark, opts.parallelism)  # while the checkpoint, connectors and query start
    steps.mark("Spark session")
    if opts.code_dir is not None:
        ship_code(spark, opts.code_dir)
    cp = _checkpoint(spark, client, keyspace, job, opts)
    job, dead, sinks = _prepare_connectors(job, opts)
    check_paths([c for _, c in job.sources] + sinks, spark.sparkContext.master)
    state = _new_run(job, spark, mode, redis, client, keyspace, config, opts, scopes, durability)
    if mode is Guarantee.EXACTLY_ONCE:  # a Redis that went back behind the checkpoint: stop
        check_markers(state.targets(), cp.last_committed(), keyspace.namespace)
    state.ticker = _ticker(state, opts)
    state.stop, state.stop_after, state.checkpoint = stop, opts.stop_after_batches, cp
    state.exporter = _exporter(state, opts)
    steps.mark("checkpoint and connectors")
    state.started = began
    heartbeat = DriverHeartbeat(client, keyspace, driver_info(state.epoch, job.pipeline)).start()
    try:
        if not stop.requested:
            query = _start_query(state, cp.location, opts.available_now, opts.trigger_seconds)
            steps.mark("query start")
            state.startup = steps.seconds
            _await(query, state, opts.timeout_seconds)
        _finish(state, cp, sinks)
        if state.exporter is not None:
            state.exporter.stopped()
            _linger(stop, opts.metrics_linger)
    finally:
        heartbeat.stop()
        if state.exporter is not None:
            state.exporter.close()
    return RunResult(
        pipeline=job.pipeline,
        job=job,
        mode=mode,
        seconds=time.monotonic() - state.started,
        counters=dict(state.metrics.value),
        dead_letter_sink=dead.describe(),
        batches=state.batches,
        extra={
            "epoch": state.epoch,
            "namespace": keyspace.namespace,
            "checkpoint": cp.location,
            "history": state.history,
            "stopped_by": stop.reason,
        },
    )


def _connect(job: Job) -> None:
    """Wait (a bounded time) until each source's and sink's system answers, before Spark starts.

    A broker down at start is a progress line every 10 s, then one line, not a traceback.
    """
    for connector in [c for _, c in job.sources] + list(job.sinks):
        connector.connect()


def _checkpoint(
    spark: SparkSession, client: Any, keyspace: Keyspace, job: Job, opts: RunConfig
) -> Checkpoint:
    """The run's checkpoint, pinned to its namespace, with its file manager chosen."""
    cp = Checkpoint(spark, checkpoint_location(opts.checkpoint, opts.output_dir, job.pipeline))
    pin_checkpoint(client, keyspace, cp)
    if opts.guarantee is Guarantee.EXACTLY_ONCE:
        check_not_behind(client, keyspace, cp)
    choose_manager(spark, cp, opts.spark_conf or {})
    return cp


def _pin_namespace(
    job: Job,
    opts: RunConfig,
    config: DedupConfig,
    redis: RedisSettings,
    client: Any,
    keyspace: Keyspace,
) -> tuple[Scopes, Durability | None]:
    """Check every master is durable enough, then pin the namespace's settings and plan.

    Returns the namespace's partition scopes and, for exactly-once, what each batch waits for.
    """
    exactly_once = opts.guarantee is Guarantee.EXACTLY_ONCE
    check_durable(client, opts.allow_non_durable_redis)  # before anything is written
    if exactly_once:
        settle_aof(client)  # a torn transaction its AOF may end in goes before any write
        _durability(opts, [client])
    new = not client.hexists(keyspace.meta, "parallelism")
    previous = stored_stages(client, keyspace)  # before a changed plan replaces them
    pin_settings(client, keyspace, opts.parallelism, config)
    pin_plan(client, keyspace, job, opts.parallelism, opts.accept_plan_change, exactly_once)
    exchanges = [s.name for s in job.stages if s.exchange]
    stages = [s.name for s in job.stages]
    scopes = pin_scopes(client, keyspace, exchanges, stages, previous, opts.parallelism, new)
    masters = _masters(scopes, redis)
    for master in masters[1:]:  # the partition scopes' masters, before anything goes there
        check_durable(master, opts.allow_non_durable_redis)
        if exactly_once:
            settle_aof(master)
    return scopes, _durability(opts, masters) if exactly_once else None


def _durability(opts: RunConfig, masters: list[Any]) -> Durability:
    """What each batch waits for on ``masters``; a Redis that cannot confirm it is refused."""
    allow = opts.allow_unconfirmed_fsync or opts.allow_non_durable_redis
    return plan_durability(masters, opts.redis_wait_replicas, DEFAULT_TIMEOUT_MS, allow)


def _masters(scopes: Scopes, redis: RedisSettings) -> list[Any]:
    """Every master the pipeline writes to, as one client each (per tag on a cluster)."""
    pairs = [(ks, redis_client(redis, ks.tag)) for ks in scopes.keyspaces()]
    return [client for _, client in distinct(pairs)]


def _linger(stop: StopRequest, seconds: float | None) -> None:
    """Keep serving metrics a while after the run, until a signal asks to stop."""
    if not seconds or stop.signals:
        return
    stop.event.clear()
    stop.wait(seconds)


def _session_conf(job: Job, extra: dict[str, str] | None) -> dict[str, str]:
    """What the sources need of a new session, then the user's settings (jars joined)."""
    conf = session_conf(c for _, c in job.sources)
    for key, value in (extra or {}).items():
        if key == "spark.jars" and conf.get(key):
            conf[key] = ",".join(j for j in (conf[key], value) if j)
        else:
            conf[key] = value
    return conf


def _exporter(state: StreamingRun, opts: RunConfig) -> Any:
    """The metrics endpoint (``metrics_port``), serving; None without one."""
    if opts.metrics_port is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    from onceflow.runtime.exporter import RunExporter

    try:
        release = version("onceflow")
    except PackageNotFoundError:
        release = "unknown"
    exporter = RunExporter(
        state.job.pipeline,
        state.keyspace.namespace,
        state.mode.value,
        release,
        [s.name for s in state.job.stages],
    )
    url = exporter.serve(opts.metrics_host, opts.metrics_port)
    exporter.started(state.epoch)
    _say(state.job.pipeline, f"metrics: {url}")
    return exporter


def _prepare_connectors(job: Job, opts: RunConfig) -> tuple[Job, Any, list[Any]]:
    """The job with its dead-letter sink, and every sink, prepared for a streaming run."""
    dead = _dead_letters(job, opts.output_dir)
    job = job.with_dead_letters(dead)
    for _, connector in job.sources:
        if opts.max_records_per_batch is not None:
            connector.max_records_per_batch = opts.max_records_per_batch
        connector.prepare(job.pipeline, True)
    return job, dead, prepare_sinks(job, dead, True, opts.progress)


def _new_run(
    job: Job,
    spark: SparkSession,
    mode: Guarantee,
    redis: RedisSettings,
    client: Any,
    keyspace: Keyspace,
    config: DedupConfig,
    opts: RunConfig,
    scopes: Scopes,
    durability: Durability | None,
) -> StreamingRun:
    """A new driver epoch (fencing older drivers), its guards and durability waits."""
    connect: Connect = lambda tag: redis_client(redis, tag)  # noqa: E731
    if mode is Guarantee.EXACTLY_ONCE and durability is not None:
        epoch = int(client.incr(keyspace.epoch))
        raise_epochs(scopes, epoch, connect)  # fences older drivers' tasks in every scope
        guards: Any = ExactlyOnceGuards(
            redis,
            keyspace.namespace,
            epoch,
            config,
            wait_timeout_ms=durability.timeout_ms,
            scoped=scopes.stages,
            parallelism=opts.parallelism,
        )
    else:  # an epoch too: batch parameters (the watermark windows fire by) are fenced by it
        epoch = int(client.incr(keyspace.epoch))
        guards = AtLeastOnceGuards(redis, keyspace.namespace, config, scoped=scopes.stages)
    run = StreamingRun(
        job,
        spark,
        mode,
        guards,
        client,
        keyspace,
        epoch,
        opts.parallelism,
        spark.sparkContext.accumulator({}, CounterParam()),
        opts.progress,
        config,
        durability,
    )
    run.scopes = scopes
    run.connect = connect
    run.redis_restarts = max(0, opts.redis_restarts)
    run.clock = BatchClock((job.event_time or EventTime()).max_clock_skew_ms)
    return run


def _ticker(state: StreamingRun, opts: RunConfig) -> Ticker | None:
    """A ticker when the job has windows and a source that can tick (see ``runtime.ticks``)."""
    sources = [
        c
        for _, c in state.job.sources
        if hasattr(c, "tick_file") and getattr(c, "client", "python") != "spark"
    ]
    ticker = Ticker(
        state.client,
        state.keyspace,
        state.scopes or Scopes(state.keyspace.namespace),
        state.connect or (lambda _tag: state.client),
        state.job,
        state.parallelism,
        os.path.abspath(os.path.join(opts.output_dir, state.job.pipeline, "onceflow-tick")),
        processing_time=not opts.available_now,
    )
    if not ticker.needed or not sources:
        return None
    sources[0].tick_file = ticker.path
    state.trigger_ms = round(_trigger_seconds(opts.trigger_seconds) * 1000)
    return ticker


def _finish(state: StreamingRun, cp: Checkpoint, sinks: list[Any]) -> None:
    """Acknowledge the last committed batch; tell sources and sinks the run ended."""
    done = cp.last_committed()
    if done is not None:
        if state.mode is Guarantee.EXACTLY_ONCE:
            acknowledge(state.client, state.keyspace, done)
        for (_, connector), offsets in zip(state.job.sources, cp.end_offsets(done), strict=False):
            if offsets is not None:
                connector.committed(offsets)
    for sink in sinks:
        sink.finish()


def _check_sources(job: Job) -> None:
    for stage, op in job.stateful_ops():
        w = op.windowing
        if w is not None and w.is_global and not w.trigger.has_early:
            msg = (
                f"combine {op.name!r} (stage {stage.name!r}) uses the global window, which "
                "never closes in a stream: its results would never be emitted; give it early "
                "panes, e.g. trigger=Trigger(early_every=1000) or Trigger(early_seconds=60)"
            )
            raise ConfigError(msg)
    for name, connector in job.sources:
        if connector.bounded:
            msg = (
                f"source {name!r} ({connector.describe()}) is bounded; a streaming "
                "pipeline reads only streams (Kafka): run bounded pipelines separately"
            )
            raise ConfigError(msg)
    _connect(job)


def _dead_letters(job: Job, output_dir: str) -> Any:
    if job.dead_letters is not None:
        return job.dead_letters
    for _, connector in job.sources:
        if isinstance(connector, KafkaSource):
            return KafkaDeadLetterSink(
                f"{job.pipeline}.dead-letters",
                bootstrap_servers=connector.settings.bootstrap_servers,
                connection=connector.settings.options,
                client=CONFLUENT_CLIENT if connector.client == CONFLUENT_CLIENT else PYTHON_CLIENT,
            )
    return JsonLinesSink(os.path.join(output_dir, job.pipeline, "dead-letters"))


def _start_query(
    state: StreamingRun, checkpoint: str, available_now: bool, trigger_seconds: float | None
) -> Any:
    from pyspark.sql import functions as F  # noqa: N812

    frames = []
    one_query(state.job.sources)
    for i, (name, connector) in enumerate(state.job.sources):
        df = connector.stream(state.spark, state.job.pipeline, name)
        # several sources are one query: a column says which source each row is from
        frames.append(df.withColumn("src", F.lit(i)) if len(state.job.sources) > 1 else df)
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
        seconds = _trigger_seconds(trigger_seconds)
        writer = writer.trigger(processingTime=f"{seconds} seconds")
    return writer.start()


def one_query(sources: Sequence[tuple[str, Any]]) -> None:
    """Make the sources of one query agree: the same columns, and stable task numbers.

    Sources reading their offset ranges in the task give ranges, others raw rows: in a union
    with any of the latter, all give raw rows. A union's task numbers run on from one source's
    partitions to the next: where Spark plans a source's partitions itself, a replay may number
    the other sources' ranges differently, and a record's position no longer says which task
    met it, so no source of that query takes its position IDs as settled by its task's backup.
    """
    if len(sources) < 2:
        return
    if not all(getattr(c, "read_in_task", False) for _, c in sources):
        for _, connector in sources:
            if getattr(connector, "read_in_task", False):
                connector.read_in_task = False
    if any(not getattr(c, "positional_ids", True) for _, c in sources):
        for _, connector in sources:
            if getattr(connector, "positional_ids", False):
                connector.positional_ids = False


def _trigger_seconds(given: float | None) -> float:
    """The micro-batch interval: ``given`` (0: each batch starts as soon as the last ends)."""
    if given is None:
        return DEFAULT_TRIGGER_SECONDS
    if given < 0:
        msg = f"trigger_seconds must be 0 or more, got {given}"
        raise ConfigError(msg)
    return given


def _await(query: Any, state: StreamingRun, timeout: float | None) -> None:
    """Wait for the query to end; after a stop request, stop it between micro-batches."""
    deadline = time.monotonic() + timeout if timeout else None
    failure: Exception | None = None
    logged = -1
    try:
        while query.isActive:
            try:
                if query.awaitTermination(AWAIT_STEP_SECONDS):
                    break
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # noqa: BLE001 - the query failed: told below in one line
                failure = exc
                break
            logged = _log_triggers(query, logged)
            if deadline is not None and time.monotonic() > deadline:
                state.stop.request(f"timeout of {timeout} s")
            if state.stop.requested and not _trigger_active(query):
                query.stop()
                break
    except KeyboardInterrupt:
        query.stop()
        raise
    error = query.exception() or failure
    if error is not None:
        text = str(error)
        if state.stop.requested and STOP_MARK in text:
            return  # a micro-batch refused to start: nothing of it ran
        if "FencedError" in text:
            msg = f"pipeline {state.job.pipeline!r} was fenced: {text[:500]}"
            raise RunError(msg)
        raise RunError(explain_failure(state.job.pipeline, Exception(text), log_file()))


def _log_triggers(query: Any, logged: int) -> int:
    """Log Spark's own timings of the micro-batches that ended since batch ``logged``.

    ``trigger`` is the whole micro-batch; ``addBatch`` is our ``foreachBatch`` (its phases are
    logged by the batch itself); the rest is Spark's bookkeeping around it (reading the
    sources' latest offsets, writing the offset and commit logs). Monitoring only.
    """
    if not log.isEnabledFor(logging.INFO):
        return logged
    try:
        progress = [p for p in query.recentProgress if p.batchId > logged]
    except Exception as exc:  # noqa: BLE001 - the query just ended
        log.debug("no progress to log: %s", exc)
        return logged
    for p in progress:
        ms = dict(p.durationMs or {})
        trigger = ms.pop("triggerExecution", 0)
        parts = ", ".join(f"{k} {v / 1000:.3f} s" for k, v in sorted(ms.items()))
        log.info("batch %d trigger: %.3f s (%s)", p.batchId, trigger / 1000, parts)
        logged = max(logged, p.batchId)
    return logged


def _trigger_active(query: Any) -> bool:
    """Whether Spark is inside a trigger (planning, running or committing a micro-batch)."""
    try:
        return bool(query.status.get("isTriggerActive", True))
    except Exception:  # noqa: BLE001 - the query just ended: nothing to wait for
        return False
