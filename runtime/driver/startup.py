"""Start-up of a streaming run: checks, the pinned namespace, connectors, a complete context.

In order: the sources and sinks are checked and their systems answer; every Redis master is
durable enough and the namespace's settings and plan are pinned (:func:`pin_namespace`); then,
once the Spark session is up, :func:`start` pins the checkpoint, prepares the connectors,
takes a new fencing epoch (older drivers' tasks can no longer commit) and returns a
:class:`~.run_context.RunContext` with every field set. The user's connector
objects are never changed: the run reads copies (see
:meth:`~onceflow.connectors.base.SourceConnector.for_run`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from onceflow.connectors.base import SourceRun
from onceflow.connectors.files import JsonLinesSink
from onceflow.dedup.aof import settle_aof
from onceflow.dedup.clock import BatchClock
from onceflow.dedup.config import DedupConfig
from onceflow.dedup.durability import (
    DEFAULT_TIMEOUT_MS,
    UNCONFIRMED_WARNING,
    Durability,
    check_markers,
    inherit_markers,
    plan_durability,
)
from onceflow.dedup.guard import ExactlyOnceGuards
from onceflow.kernel.errors import ConfigError
from onceflow.kernel.eventtime import EventTime
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.records import Guarantee
from onceflow.kernel.scopes import (
    Connect,
    Scopes,
    distinct,
    pin_scopes,
    raise_epochs,
    stored_stages,
)
from onceflow.kernel.settings import RedisSettings, check_durable, redis_client
from onceflow.kernel.store import store_for
from onceflow.runtime.driver.bounded import prepare_sinks
from onceflow.runtime.driver.checkpoint import Checkpoint, choose_manager
from onceflow.runtime.driver.heartbeat import TTL_MS as HEARTBEAT_TTL_MS
from onceflow.runtime.driver.observe import exporter
from onceflow.runtime.driver.phases import Phases
from onceflow.runtime.driver.pinning import (
    check_not_behind,
    note_staging,
    pin_checkpoint,
    pin_plan,
    pin_settings,
)
from onceflow.runtime.driver.placement import check_paths
from onceflow.runtime.driver.query import trigger_seconds_of
from onceflow.runtime.driver.rescale import print_step, rescale
from onceflow.runtime.driver.rescale_checks import refuse_while_rescaling, underway
from onceflow.runtime.driver.run_config import RunConfig
from onceflow.runtime.driver.run_context import RunContext
from onceflow.runtime.driver.stopping import StopRequest
from onceflow.runtime.driver.ticks import Ticker
from onceflow.runtime.guard import AtLeastOnceGuards
from onceflow.runtime.metrics import CounterParam
from onceflow.runtime.spec import Job

log = logging.getLogger(__name__)
JARS = "spark.jars"  # a setting several sources (and the user) may each add to

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


@dataclass(frozen=True)
class Namespace:
    """The pipeline's Redis namespace, checked and pinned before Spark starts."""

    redis: RedisSettings
    client: Any
    keyspace: Keyspace
    config: DedupConfig
    scopes: Scopes
    durability: Durability | None  # what each batch waits for (exactly-once only)


def check_sources(job: Job) -> None:
    """Refuse what a stream cannot run; wait (a bounded time) until every system answers.

    A broker down at start is a progress line every 10 s, then one line, not a traceback.
    """
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
                "pipeline reads only streams (Kafka, a folder watched with watch=True): run "
                "bounded pipelines separately"
            )
            raise ConfigError(msg)
    for connector in [c for _, c in job.sources] + list(job.sinks):
        connector.connect()


def open_namespace(job: Job, opts: RunConfig) -> Namespace:
    """Connect to the pipeline's namespace; check and pin it (see :func:`pin_namespace`)."""
    config = opts.dedup or job.dedup or DedupConfig()
    redis = RedisSettings.from_env(opts.redis_url, **(opts.redis_options or {}))
    keyspace = Keyspace(opts.namespace or job.pipeline)
    client = redis_client(redis, keyspace.namespace)
    scopes, durability = pin_namespace(job, opts, config, redis, client, keyspace)
    if durability is not None and durability.unconfirmed:  # allowed: say what it costs
        log.warning("%s", UNCONFIRMED_WARNING)
        print(f"warning: {UNCONFIRMED_WARNING}", file=sys.stderr, flush=True)
    return Namespace(redis, client, keyspace, config, scopes, durability)


def pin_namespace(
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
    new = not store_for(client).hexists(keyspace.meta, "parallelism")
    if not new:
        _rescale_first(job, opts, redis, client, keyspace, exactly_once)
    previous = stored_stages(client, keyspace)  # before a changed plan replaces them
    pin_settings(client, keyspace, opts.parallelism, config)
    pin_plan(client, keyspace, job, opts.parallelism, opts.accept_plan_change, exactly_once)
    exchanges = [s.name for s in job.stages if s.exchange]
    stages = [s.name for s in job.stages]

    def marked_alike(added: list[Keyspace]) -> None:  # new scopes: as durable as the home
        pairs = [(ks, redis_client(redis, ks.tag)) for ks in added]
        inherit_markers((keyspace, client), pairs)

    scopes = pin_scopes(
        client,
        keyspace,
        exchanges,
        stages,
        previous,
        opts.parallelism,
        new,
        on_added=marked_alike,
    )
    masters = _masters(scopes, redis)
    for master in masters[1:]:  # the partition scopes' masters, before anything goes there
        check_durable(master, opts.allow_non_durable_redis)
        if exactly_once:
            settle_aof(master)
    return scopes, _durability(opts, masters) if exactly_once else None


def _rescale_first(
    job: Job,
    opts: RunConfig,
    redis: RedisSettings,
    client: Any,
    keyspace: Keyspace,
    exactly_once: bool,
) -> None:
    """Another parallelism than the namespace's (or a rescale cut short): move the state first.

    Only with ``--rescale``: a parallelism forgotten on a restart (the default is 2) must not
    move a large pipeline's state by surprise. The plan must be the stored one (or accepted)
    before anything moves.
    """
    stored = int(store_for(client).hget(keyspace.meta, "parallelism") or 0)
    record = underway(client, keyspace)
    if stored == opts.parallelism and record is None:
        return
    if not opts.rescale:
        what = (
            f"a rescale to {record['target']} partitions was cut short"
            if record is not None
            else f"was made with parallelism={stored}, this run asks for {opts.parallelism}"
        )
        msg = (
            f"pipeline namespace {keyspace.namespace!r} {what}: pass --rescale to move its "
            f"keyed state and dedup history to {opts.parallelism} partitions first (onceflow "
            f"rescale does the same on its own), or run with --parallelism {stored}"
        )
        raise ConfigError(msg)
    pin_plan(client, keyspace, job, stored, opts.accept_plan_change, exactly_once)
    rescale(
        client,
        keyspace.namespace,
        opts.parallelism,
        connect=lambda tag: redis_client(redis, tag),
        wait_s=HEARTBEAT_TTL_MS / 1000 + 5,
        say=print_step,
    )


def _durability(opts: RunConfig, masters: list[Any]) -> Durability:
    """What each batch waits for on ``masters``; a Redis that cannot confirm it is refused."""
    allow = opts.allow_unconfirmed_fsync or opts.allow_non_durable_redis
    return plan_durability(
        masters,
        opts.redis_wait_replicas,
        DEFAULT_TIMEOUT_MS,
        allow,
        allow_non_durable=opts.allow_non_durable_redis,
    )


def _masters(scopes: Scopes, redis: RedisSettings) -> list[Any]:
    """Every master the pipeline writes to, as one client each (per tag on a cluster)."""
    pairs = [(ks, redis_client(redis, ks.tag)) for ks in scopes.keyspaces()]
    return [client for _, client in distinct(pairs)]


def spark_conf(job: Job, extra: dict[str, str] | None) -> dict[str, str]:
    """What the sources need of a new session, then the user's settings (jars joined)."""
    conf: dict[str, str] = {}
    for settings in [*(c.spark_conf() for _, c in job.sources), extra or {}]:
        for key, value in settings.items():
            if key == JARS and conf.get(key):
                jars = conf[key].split(",")
                conf[key] = ",".join(jars + [j for j in value.split(",") if j and j not in jars])
            else:
                conf[key] = value
    return conf


def checkpoint_location(given: str | None, output_dir: str, pipeline: str) -> str:
    """Where a query's checkpoint is: ``given``, else ``<output_dir>/<pipeline>/checkpoint``.

    A plain path is made absolute against the folder the run starts from, so the location is
    fixed before the query starts and printed as such; a URL (``file://``, ``hdfs://``,
    ``s3a://`` ...) is kept as it is. A run started from another folder therefore finds
    another (empty) checkpoint: :func:`~.pinning.pin_checkpoint` refuses it
    rather than re-reading input against the namespace's state.
    """
    location = given or os.path.join(output_dir, pipeline, "checkpoint")
    if "://" in location:
        return location
    return os.path.abspath(location)


def _checkpoint(spark: SparkSession, ns: Namespace, job: Job, opts: RunConfig) -> Checkpoint:
    """The run's checkpoint, pinned to its namespace, with its file manager chosen."""
    cp = Checkpoint(spark, checkpoint_location(opts.checkpoint, opts.output_dir, job.pipeline))
    pin_checkpoint(ns.client, ns.keyspace, cp)
    if opts.guarantee is Guarantee.EXACTLY_ONCE:
        check_not_behind(ns.client, ns.keyspace, cp)
    choose_manager(spark, cp, opts.spark_conf or {})
    return cp


def streaming_dead_letters(job: Job, output_dir: str) -> Any:
    """The pipeline's dead-letter sink; else its first source's default; else a file."""
    if job.dead_letters is not None:
        return job.dead_letters
    for _, connector in job.sources:
        sink = connector.dead_letter_sink(job.pipeline)
        if sink is not None:
            return sink
    return JsonLinesSink(os.path.join(output_dir, job.pipeline, "dead-letters"))


def one_query(sources: Sequence[Any]) -> SourceRun:
    """What the sources of one query must agree on: the same columns, stable task numbers.

    Sources reading their offset ranges in the task give ranges, others raw rows: in a union
    with any of the latter, all give raw rows. A union's task numbers run on from one source's
    partitions to the next: where Spark plans a source's partitions itself, a replay may number
    the other sources' ranges differently, and a record's position no longer says which task
    met it, so no source of that query takes its position IDs as settled by its task's backup.
    """
    if len(sources) < 2:
        return SourceRun()
    caps = [c.capabilities() for c in sources]
    return SourceRun(
        read_in_task=all(c.reads_in_task for c in caps),
        positional_ids=all(c.stable_partitions for c in caps),
    )


def run_sources(job: Job, opts: RunConfig, tick_file: str | None) -> Job:
    """The job reading each source as this run does: copies with the run's settings.

    ``tick_file`` goes to the first source that can tick (None: the run needs no ticks).
    """
    union = one_query([c for _, c in job.sources])
    ticking = next((n for n, c in job.sources if c.capabilities().ticks), None)
    copies = {
        name: connector.for_run(
            replace(
                union,
                tick_file=tick_file if name == ticking else None,
                max_records_per_batch=opts.max_records_per_batch,
            )
        )
        for name, connector in job.sources
    }
    return job.with_sources(copies)


INCARNATION_CHARS = 12  # of the namespace's run identity, in sinks' delivery marks


def _guards(
    job: Job, mode: Guarantee, ns: Namespace, opts: RunConfig, connect: Connect, identity: str
) -> tuple[int, Any]:
    """A new driver epoch (fencing older drivers) and the run's guards.

    ``identity``: the namespace's run identity (new at each reset), the incarnation in
    sinks' delivery marks (see :mod:`onceflow.runtime.task.sink_delivery`).
    """
    epoch = store_for(ns.client).incr(ns.keyspace.epoch)
    refuse_while_rescaling(ns.client, ns.keyspace)  # after the epoch: see the function
    if mode is Guarantee.EXACTLY_ONCE and ns.durability is not None:
        raise_epochs(ns.scopes, epoch, connect)  # fences older drivers' tasks in every scope
        return epoch, ExactlyOnceGuards(
            ns.redis,
            ns.keyspace.namespace,
            epoch,
            ns.config,
            wait_timeout_ms=ns.durability.timeout_ms,
            scoped=ns.scopes.stages,
            parallelism=opts.parallelism,
            feeds=frozenset(p for s in job.stages for p in s.producers),
            incarnation=identity[:INCARNATION_CHARS],
        )
    # an epoch too: batch parameters (the watermark windows fire by) are fenced by it
    guards = AtLeastOnceGuards(ns.redis, ns.keyspace.namespace, ns.config, scoped=ns.scopes.stages)
    return epoch, guards


def _ticker(job: Job, ns: Namespace, opts: RunConfig, connect: Connect) -> Ticker | None:
    """A ticker when the job has windows and a source that can tick (see ``runtime.ticks``)."""
    ticker = Ticker(
        ns.client,
        ns.keyspace,
        ns.scopes,
        connect,
        job,
        opts.parallelism,
        os.path.abspath(os.path.join(opts.output_dir, job.pipeline, "onceflow-tick")),
        processing_time=not opts.available_now,
    )
    if not ticker.needed or not any(c.capabilities().ticks for _, c in job.sources):
        return None
    return ticker


def start(
    job: Job,
    spark: SparkSession,
    ns: Namespace,
    opts: RunConfig,
    stop: StopRequest,
    steps: Phases,
    began: float,
) -> RunContext:
    """Pin the checkpoint, prepare the connectors, take an epoch: the run's whole context."""
    cp = _checkpoint(spark, ns, job, opts)
    dead = streaming_dead_letters(job, opts.output_dir)
    job = job.with_dead_letters(dead)
    connect: Connect = lambda tag: redis_client(ns.redis, tag)  # noqa: E731
    ticker = _ticker(job, ns, opts, connect)
    job = run_sources(job, opts, ticker.path if ticker is not None else None)
    for _, connector in job.sources:
        connector.prepare(job.pipeline, True)
    sinks = prepare_sinks(job, dead, True, opts.progress)
    check_paths([c for _, c in job.sources] + sinks, spark.sparkContext.master)
    epoch, guards = _guards(job, opts.guarantee, ns, opts, connect, cp.identity() or "")
    if opts.guarantee is Guarantee.EXACTLY_ONCE:  # a Redis that went back behind the checkpoint
        targets = [(ks, connect(ks.tag)) for ks in ns.scopes.keyspaces()]
        check_markers(targets, cp.last_committed(), ns.keyspace.namespace)
        staging = [c.staging_folder() for c in sinks]
        note_staging(ns.client, ns.keyspace, [f for f in staging if f is not None])
    served = exporter(
        job.pipeline,
        ns.keyspace.namespace,
        opts.guarantee.value,
        [s.name for s in job.stages],
        opts.metrics_port,
        opts.metrics_host,
        epoch,
    )
    return RunContext(
        job=job,
        spark=spark,
        mode=opts.guarantee,
        guards=guards,
        client=ns.client,
        keyspace=ns.keyspace,
        epoch=epoch,
        parallelism=opts.parallelism,
        metrics=spark.sparkContext.accumulator({}, CounterParam()),
        progress=opts.progress,
        config=ns.config,
        durability=ns.durability,
        scopes=ns.scopes,
        connect=connect,
        redis_restarts=max(0, opts.redis_restarts),
        clock=BatchClock((job.event_time or EventTime()).max_clock_skew_ms),
        ticker=ticker,
        trigger_ms=round(trigger_seconds_of(opts.trigger_seconds) * 1000) if ticker else 1000,
        stop=stop,
        stop_after=opts.stop_after_batches,
        checkpoint=cp,
        exporter=served,
        dead_letters=dead,
        sinks=tuple(sinks),
        steps=steps,
        started=began,
    )
