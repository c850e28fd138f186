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

The parts: :mod:`~.startup` (checks, the pinned namespace, a complete :mod:`~.run_context`),
:mod:`~.batch_run` (one micro-batch), :mod:`~.query` (the query, started and waited for) and
:mod:`~.observe` (progress lines, metrics); this module runs them in order.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from onceflow.backup.store import acknowledge
from onceflow.kernel.records import Guarantee
from onceflow.runtime.driver.batch_run import MicroBatches
from onceflow.runtime.driver.heartbeat import DriverHeartbeat, driver_info
from onceflow.runtime.driver.observe import say
from onceflow.runtime.driver.phases import Phases
from onceflow.runtime.driver.query import await_query, linger, start_query
from onceflow.runtime.driver.result import RunResult
from onceflow.runtime.driver.run_config import RunConfig
from onceflow.runtime.driver.run_context import RunContext
from onceflow.runtime.driver.shipping import ship_code
from onceflow.runtime.driver.startup import check_sources, open_namespace, spark_conf, start
from onceflow.runtime.driver.stopping import SignalHandlers, StopRequest, stop_on_signals
from onceflow.runtime.spark_env.session import (
    adopt,
    default_log_file,
    prime_data_sources,
    spark_session,
    warm_workers,
)
from onceflow.runtime.spec import Job

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def run_streaming(job: Job, opts: RunConfig, session: SparkSession | None = None) -> RunResult:
    """Run an unbounded job as a streaming query, with the settings of ``opts``.

    ``available_now`` processes what the topics hold at start, in capped micro-batches, then
    stops (tests, backfills); otherwise a micro-batch starts every ``trigger_seconds`` (1 s)
    until ``stop_after_batches`` or ``timeout_seconds``, or SIGTERM or SIGINT (Ctrl-C): each
    lets the micro-batch under way finish, then the run ends normally (see
    :mod:`~.stopping`). ``checkpoint`` (default
    ``<output_dir>/<pipeline>/checkpoint``, made absolute) and the Redis namespace (default
    the pipeline's name) together identify the pipeline's progress: keep both to resume after
    a crash (a mismatch is refused). ``accept_plan_change`` resumes a namespace whose stored
    plan differs from this one (the dedup history of stages whose names changed starts
    over). At the end of every micro-batch the driver waits until its writes are durable (the
    AOF fsync where Redis can confirm it, and ``redis_wait_replicas`` replicas: by default
    one if Redis has any). ``metrics_port`` serves Prometheus metrics on ``metrics_host``
    (loopback by default; see :mod:`~.exporter`), ``metrics_linger`` seconds past the run's
    end; ``spark_conf`` and ``log_level`` apply to the session the run starts.
    """
    stop = StopRequest()
    with stop_on_signals(stop, lambda line: say(job.pipeline, line)) as handlers:
        return _run(job, session, opts, handlers)


def _run(
    job: Job, session: SparkSession | None, opts: RunConfig, handlers: SignalHandlers
) -> RunResult:
    began = time.monotonic()
    steps = Phases(began)
    stop = handlers.stop
    check_sources(job)  # and wait for their systems (and the sinks')
    steps.mark("Kafka")
    ns = open_namespace(job, opts)
    steps.mark("Redis")
    spark = session or spark_session(
        opts.master,
        app_name=job.pipeline,
        parallelism=opts.parallelism,
        log_path=default_log_file(job.pipeline, opts.output_dir),
        log_level=opts.log_level,
        extra_conf=spark_conf(job, opts.spark_conf),
    )
    handlers.install()  # over PySpark's SIGINT handler, set when its context started
    adopt(spark)
    warm_workers(spark, opts.parallelism)  # while the checkpoint, connectors and query start
    if any(c.capabilities().python_data_source for _, c in job.sources):
        prime_data_sources(spark)  # while the checkpoint and connectors are prepared
    steps.mark("Spark session")
    if opts.code_dir is not None:
        ship_code(spark, opts.code_dir)
    ctx = start(job, spark, ns, opts, stop, steps, began)
    steps.mark("checkpoint and connectors")
    batches = MicroBatches(ctx)
    _drive(ctx, batches, opts)
    return RunResult(
        pipeline=job.pipeline,
        job=ctx.job,
        mode=ctx.mode,
        seconds=time.monotonic() - ctx.started,
        counters=dict(ctx.metrics.value),
        dead_letter_sink=ctx.dead_letters.describe(),
        batches=batches.batches,
        extra={
            "epoch": ctx.epoch,
            "namespace": ctx.keyspace.namespace,
            "checkpoint": ctx.checkpoint.location,
            "history": batches.history,
            "stopped_by": stop.reason,
        },
    )


def _drive(ctx: RunContext, batches: MicroBatches, opts: RunConfig) -> None:
    """Start the query and wait for it (with the driver's heartbeat), then finish the run."""
    info = driver_info(ctx.epoch, ctx.job.pipeline)
    heartbeat = DriverHeartbeat(ctx.client, ctx.keyspace, info).start()
    try:
        if not ctx.stop.requested:
            query = start_query(
                ctx.spark,
                ctx.job,
                batches.run_batch,
                ctx.checkpoint.location,
                opts.available_now,
                opts.trigger_seconds,
                ctx.steps,
            )
            ctx.steps.mark("query start")
            await_query(query, ctx.job.pipeline, ctx.stop, opts.timeout_seconds)
        _finish(ctx)
        if ctx.exporter is not None:
            ctx.exporter.stopped()
            linger(ctx.stop, opts.metrics_linger)
    finally:
        heartbeat.stop()
        if ctx.exporter is not None:
            ctx.exporter.close()


def _finish(ctx: RunContext) -> None:
    """Acknowledge the last committed batch; tell sources and sinks the run ended."""
    cp = ctx.checkpoint
    done = cp.last_committed()
    if done is not None:
        if ctx.mode is Guarantee.EXACTLY_ONCE:
            acknowledge(ctx.client, ctx.keyspace, done)
        for (_, connector), offsets in zip(ctx.job.sources, cp.end_offsets(done), strict=False):
            if offsets is not None:
                connector.committed(offsets)
    for sink in ctx.sinks:
        sink.finish()
