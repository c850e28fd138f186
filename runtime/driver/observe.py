"""Watching a streaming run: where time went, progress lines, the metrics endpoint.

Monitoring only: nothing here may fail a micro-batch (a probe that cannot answer is logged).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from onceflow.kernel.store import store_for
from onceflow.runtime.driver.phases import Phases

if TYPE_CHECKING:
    from onceflow.runtime.driver.run_context import RunContext

log = logging.getLogger(__name__)

Offsets = dict[tuple[str, str, int], tuple[int, int | None]]


@dataclass(frozen=True)
class BatchDone:
    """A committed micro-batch, as observation sees it."""

    batch_id: int
    records: int
    seconds: float
    delta: dict[str, int]  # counters this batch added
    params: Any  # its BatchParams


def say(pipeline: str, line: str) -> None:
    """One line for the person running the pipeline, on standard error."""
    print(f"[{pipeline}] {line}", file=sys.stderr, flush=True)


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """What each counter added between two readings."""
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}


def first_batch(ctx: RunContext) -> None:
    """Say once how long the run took to reach its first micro-batch, and where."""
    ctx.steps.mark("Spark's first trigger")  # the query's start to its first foreachBatch
    took = time.monotonic() - ctx.started
    parts = ", ".join(f"{k} {v:.1f} s" for k, v in ctx.steps.seconds.items())
    line = f"first micro-batch starts {took:.1f} s after the run began ({parts})"
    log.info(line)
    if ctx.progress:
        say(ctx.job.pipeline, line)


def batch_done(ctx: RunContext, done: BatchDone, phases: Phases) -> None:
    """Log a committed batch; feed the metrics endpoint; print its progress line."""
    log.info(
        "batch %d: %d records in %.2f s; counters %s",
        done.batch_id,
        done.records,
        done.seconds,
        done.delta,
    )
    log.info("batch %d phases: %s", done.batch_id, phases.describe())
    if ctx.exporter is not None:
        _feed_exporter(ctx, done)
    if ctx.progress:
        _report(ctx.job.pipeline, done)


def _feed_exporter(ctx: RunContext, done: BatchDone) -> None:
    """Feed the metrics endpoint; monitoring never fails a batch."""
    from onceflow.runtime.driver.exporter import BatchView

    gc_last: int | None = None
    try:
        raw = store_for(ctx.client).hget(ctx.keyspace.gc, "last_pass_ms")
        gc_last = int(raw) if raw is not None else None
    except Exception as exc:  # noqa: BLE001 - monitoring only
        log.warning("metrics: cannot read the GC record: %s", exc)
    view = BatchView(
        done.batch_id,
        done.seconds,
        done.records,
        dict(ctx.metrics.value),
        done.params,
        offsets(ctx, done.batch_id),
        gc_last,
    )
    ctx.exporter.observe(view)


def offsets(ctx: RunContext, batch_id: int) -> Offsets:
    """Per source partition: where this batch ended, and where readable records end now."""
    out: Offsets = {}
    ends = ctx.checkpoint.end_offsets(batch_id)
    for (name, connector), value in zip(ctx.job.sources, ends, strict=False):
        now: dict[tuple[str, int], int] = {}
        if connector.capabilities().readable_ends:
            try:
                now = connector.readable_ends()
            except Exception as exc:  # noqa: BLE001 - monitoring only
                log.warning("metrics: no readable offsets for source %r: %s", name, exc)
        for (topic, partition), done in connector.positions(value).items():
            out[(name, topic, partition)] = (done, now.get((topic, partition)))
    return out


def _report(pipeline: str, done: BatchDone) -> None:
    d = done.delta
    dups = sum(v for k, v in d.items() if k.endswith("/duplicates_dropped"))
    dead = sum(v for k, v in d.items() if k.endswith("/dead_letters"))
    replayed = sum(v for k, v in d.items() if k.endswith("/replayed_outputs"))
    restamped = sum(v for k, v in d.items() if "/restamped/" in k)
    rate = done.records / done.seconds if done.seconds > 0 else 0.0
    again = f", {replayed:,} outputs replayed from backup" if replayed else ""
    if restamped:
        again += f", {restamped:,} stamped with the time of writing"
    print(
        f"[{pipeline}] batch {done.batch_id}: {done.records:,} records in, {dups:,} "
        f"duplicates dropped, {dead:,} dead letters{again}, {done.seconds:.1f} s "
        f"({rate:,.0f}/s)",
        file=sys.stderr,
        flush=True,
    )


def log_triggers(query: Any, logged: int) -> int:
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


def exporter(
    pipeline: str,
    namespace: str,
    mode: str,
    stages: list[str],
    port: int | None,
    host: str,
    epoch: int,
) -> Any:
    """The metrics endpoint on ``host:port``, serving; None without a port."""
    if port is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    from onceflow.runtime.driver.exporter import RunExporter

    try:
        release = version("onceflow")
    except PackageNotFoundError:
        release = "unknown"
    served = RunExporter(pipeline, namespace, mode, release, stages)
    url = served.serve(host, port)
    served.started(epoch)
    say(pipeline, f"metrics: {url}")
    return served
