"""One micro-batch of a streaming run: the body of Spark's ``foreachBatch``.

Spark calls it for batch *n* only after batch *n - 1* is in its commit log, so at the start of
batch *n* every backup of batches before *n* is acknowledged. A batch fixes its parameters
(watermark, time) in Redis, compiles the job over its rows, runs it as one Spark job and
waits until its writes are durable; a Redis server that restarted or failed over under it
makes it run again (see :mod:`onceflow.dedup.durability`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from onceflow.backup.store import acknowledge
from onceflow.dedup.batch import fix_batch_params
from onceflow.dedup.durability import BatchDurability, check_markers, replan, wait_durable
from onceflow.dedup.errors import FencedError, ServerChangedError, server_changed_message
from onceflow.kernel.eventtime import EventTime
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.records import Guarantee
from onceflow.kernel.scopes import distinct, merge_generations
from onceflow.kernel.store import store_for
from onceflow.runtime.driver.compile import StreamCompiler
from onceflow.runtime.driver.deferred import run_delivery_job
from onceflow.runtime.driver.observe import BatchDone, batch_done, delta, first_batch, say
from onceflow.runtime.driver.phases import Phases
from onceflow.runtime.driver.stopping import StopRequested
from onceflow.runtime.faults import CrashPoint, driver_crashpoint

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from onceflow.runtime.driver.run_context import RunContext

log = logging.getLogger(__name__)


class MicroBatches:
    """Runs a streaming run's micro-batches; keeps what changes from one to the next."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.watermark = 0
        self.batches = 0
        self.last_batch = -1
        self.history: list[tuple[int, int, float]] = []  # batch, records, seconds
        self.servers: dict[str, str] = {}  # tag -> run id when the last attempt started
        self.durability = ctx.durability  # planned again when a master changes (replan)
        self.compiler: StreamCompiler | None = None  # made at the first micro-batch
        # the next batch may run on a Redis that lost writes of an earlier attempt of it: the
        # driver's first, and one run again after a server change (see runtime.task.sink_delivery)
        self.recheck_next = True

    def run_batch(self, df: DataFrame, batch_id: int) -> None:
        """One micro-batch: acknowledge the previous ones, then run the job.

        After a stop request it refuses to start (see :mod:`~.stopping`), doing nothing. A
        Redis server that restarted or failed over during the batch makes it run again, up to
        ``redis_restarts`` times (see :mod:`onceflow.dedup.durability`).
        """
        ctx = self.ctx
        if ctx.stop.requested:
            log.info("batch %d not started (%s): the next run plans it", batch_id, ctx.stop.reason)
            raise StopRequested
        phases = Phases()
        if self.batches == 0:
            first_batch(ctx)
        self._check_epoch()
        check_sources(ctx, batch_id)
        if batch_id > 0 and ctx.mode is Guarantee.EXACTLY_ONCE:
            acknowledge(ctx.client, ctx.keyspace, batch_id - 1)
        before = dict(ctx.metrics.value)
        t0 = time.monotonic()
        again = 0
        while True:
            try:
                params = self._attempt(df, batch_id, phases)
                break
            except Exception as exc:
                if not server_changed(exc) or again >= ctx.redis_restarts:
                    raise
                again += 1
                self._run_again(batch_id, exc, again)  # the next attempt checks the servers
                self.recheck_next = True
        self.recheck_next = False
        driver_crashpoint(CrashPoint.BATCH_END, batch_id)
        if ctx.ticker is not None:
            ctx.ticker.after_batch(ctx.trigger_ms)
        phases.mark("ticks")
        self._done(batch_id, time.monotonic() - t0, before, params, phases)

    def _attempt(self, df: DataFrame, batch_id: int, phases: Phases) -> Any:
        """Fix the batch's parameters, run its job, wait until its writes are durable."""
        ctx = self.ctx
        targets = ctx.targets()
        this_batch = self._servers_now(targets, batch_id)
        server = this_batch.servers.get(ctx.keyspace.tag, "") if this_batch else ""
        params = fix_batch_params(
            ctx.client,
            ctx.keyspace,
            ctx.epoch,
            batch_id,
            ctx.config,
            ctx.job.event_time or EventTime(),
            server,
            ctx.clock,
        )
        self.watermark = params.watermark
        guards = ctx.guards.for_batch(params, this_batch, self._recheck(this_batch))
        phases.mark("params")
        self._run_job(df, batch_id, guards, phases)
        if ctx.mode is Guarantee.EXACTLY_ONCE:
            if merge_generations(ctx.client, ctx.scopes, ctx.connect, server) < 0:
                raise ServerChangedError(server_changed_message("the namespace", batch_id))
        if self.durability is not None and this_batch is not None:
            wait_durable(targets, batch_id, self.durability, this_batch)
        phases.mark("durable")
        if this_batch is not None and this_batch.waitaof:  # the sinks deliver after the wait
            run_delivery_job(ctx, guards, batch_id)
            phases.mark("deliveries")
        return params

    def _recheck(self, this_batch: BatchDurability | None) -> bool:
        """Whether this attempt's sinks must look for deliveries Redis lost the record of.

        Only when Redis may lose a delivery's record after its sink committed it (its fsync
        unconfirmed, or the sinks deliver after the batch's one wait for it: ``WAITAOF``, see
        :mod:`onceflow.runtime.task.deferred`) and the attempt may run on a Redis that went
        back (see :mod:`onceflow.runtime.task.sink_delivery`).
        """
        lossy = this_batch is not None and (this_batch.unconfirmed or this_batch.waitaof)
        return self.recheck_next and lossy

    def _servers_now(
        self, targets: list[tuple[Keyspace, Any]], batch_id: int
    ) -> BatchDurability | None:
        """Each master's server now; if one changed since the last attempt, check it.

        A server that restarted or failed over (during the last attempt, or between two
        batches) may have lost writes after the last batch's durable marker, which matter to
        nobody, or before it, or all its keys, which no rerun can redo
        (:func:`~onceflow.dedup.durability.check_markers` stops the run then). It may also
        persist otherwise than the one the run started on: the start-up checks run again on
        every master (:func:`~onceflow.dedup.durability.replan`).
        """
        durability = self.durability
        if durability is None:
            return None
        this_batch = durability.for_batch([(ks.tag, c) for ks, c in targets])
        servers = dict(this_batch.servers)
        if self.servers and servers != self.servers:
            committed = batch_id - 1 if batch_id > 0 else None
            namespace = self.ctx.keyspace.namespace
            check_markers(targets, committed, namespace, marked=self.batches > 0)
            self.durability = replan(durability, [c for _, c in distinct(targets)])
            this_batch = self.durability.for_batch([(ks.tag, c) for ks, c in targets])
        self.servers = servers
        return this_batch

    def _run_job(self, df: DataFrame, batch_id: int, guards: Any, phases: Phases) -> None:
        """Compile the batch's job over its rows and run it as one Spark job."""
        from pyspark.sql import functions as F  # noqa: N812

        ctx = self.ctx
        if len(ctx.job.sources) == 1:  # no "src" column to tell sources apart
            frames = {ctx.job.sources[0][0]: df}
        else:
            frames = {
                name: df.where(F.col("src") == i).drop("src")
                for i, (name, _) in enumerate(ctx.job.sources)
            }
        if self.compiler is None:
            self.compiler = StreamCompiler(
                ctx.job, ctx.spark, ctx.guards, ctx.parallelism, ctx.metrics
            )
        compiled = self.compiler.compile(frames, guards, batch_id)
        phases.mark("plan")
        group = f"onceflow-batch-{batch_id}"
        ctx.spark.sparkContext.setJobGroup(group, f"{ctx.job.pipeline} micro-batch {batch_id}")
        compiled.run()
        phases.mark("spark")
        phases.count_jobs(ctx.spark, group)

    def _run_again(self, batch_id: int, exc: Exception, again: int) -> None:
        """Say that a batch runs again after its Redis server changed; log why."""
        ctx = self.ctx
        log.warning("batch %d: the Redis server changed: %s", batch_id, exc)
        line = (
            f"Redis restarted or failed over during micro-batch {batch_id}: running it again "
            f"from what Redis kept ({again} of {ctx.redis_restarts})"
        )
        say(ctx.job.pipeline, line)  # an incident, not progress: said even without it

    def _done(
        self, batch_id: int, seconds: float, before: dict[str, int], params: Any, phases: Phases
    ) -> None:
        """A batch committed: history, observation, and a stop after N batches."""
        ctx = self.ctx
        self.batches += 1
        self.last_batch = batch_id
        added = delta(before, ctx.metrics.value)
        records = sum(added.get(f"{s}/in", 0) for s in ctx.job.source_stages)
        self.history.append((batch_id, records, seconds))
        batch_done(ctx, BatchDone(batch_id, records, seconds, added, params), phases)
        if ctx.stop_after is not None and self.batches >= ctx.stop_after:
            ctx.stop.request(f"stop after {ctx.stop_after} micro-batch(es)")

    def _check_epoch(self) -> None:
        ctx = self.ctx
        current = int(store_for(ctx.client).get(ctx.keyspace.epoch) or 0)
        if current != ctx.epoch:
            msg = (
                f"another driver of pipeline {ctx.job.pipeline!r} started (epoch {current}, "
                f"this one is {ctx.epoch}); this driver stops"
            )
            raise FencedError(msg)


def server_changed(exc: BaseException) -> bool:
    """Whether a batch failed because a Redis server changed (in the driver or a task)."""
    return isinstance(exc, ServerChangedError) or ServerChangedError.__name__ in str(exc)


def check_sources(ctx: RunContext, batch_id: int) -> None:
    """Each source that checks its micro-batches (a watched folder: its files still there)."""
    checking = [
        (i, c) for i, (_, c) in enumerate(ctx.job.sources) if c.capabilities().checks_batches
    ]
    if not checking:
        return
    ends = ctx.checkpoint.end_offsets(batch_id)
    starts = ctx.checkpoint.end_offsets(batch_id - 1) if batch_id > 0 else []
    for i, connector in checking:
        start = starts[i] if i < len(starts) else None
        end = ends[i] if i < len(ends) else None

        def read(name: str, n: int = i) -> str | None:
            return ctx.checkpoint.read("sources", str(n), name)

        connector.check_batch(read, start, end)
