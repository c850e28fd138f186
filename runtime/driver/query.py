"""The streaming query: the sources unioned into one, started, and waited for.

Spark keeps the sources' offsets in the query's checkpoint; each micro-batch calls the
``foreachBatch`` callback (:meth:`~.batch_run.MicroBatches.run_batch`). A stop
request (see :mod:`~.stopping`) stops the query between micro-batches.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from onceflow.kernel.errors import ConfigError
from onceflow.runtime.driver.observe import log_triggers
from onceflow.runtime.driver.result import explain_failure
from onceflow.runtime.driver.run_config import DEFAULT_TRIGGER_SECONDS
from onceflow.runtime.driver.stopping import STOP_MARK, StopRequest
from onceflow.runtime.errors import RunError
from onceflow.runtime.spark_env.session import log_file

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from onceflow.runtime.driver.phases import Phases
    from onceflow.runtime.spec import Job

AWAIT_STEP_SECONDS = 0.5

BatchCallback = Callable[["DataFrame", int], None]


def start_query(
    spark: SparkSession,
    job: Job,
    run_batch: BatchCallback,
    checkpoint: str,
    available_now: bool,
    trigger_seconds: float | None,
    steps: Phases | None = None,
) -> Any:
    """Union the job's sources into one streaming query and start it.

    ``steps`` (start-up timing) gets the sources' frames (Spark asks each Python data source
    for its schema) apart from the query's own start.
    """
    from pyspark.sql import functions as F  # noqa: N812

    frames = []
    for i, (name, connector) in enumerate(job.sources):
        df = connector.stream(spark, job.pipeline, name)
        # several sources are one query: a column says which source each row is from
        frames.append(df.withColumn("src", F.lit(i)) if len(job.sources) > 1 else df)
    union = frames[0]
    for df in frames[1:]:
        union = union.unionByName(df)
    if steps is not None:
        steps.mark("source frames")
    writer = (
        union.writeStream.foreachBatch(run_batch)
        .option("checkpointLocation", checkpoint)
        .queryName(f"onceflow-{job.pipeline}-{uuid.uuid4().hex[:6]}")
    )
    if available_now:
        writer = writer.trigger(availableNow=True)
    else:
        seconds = trigger_seconds_of(trigger_seconds)
        writer = writer.trigger(processingTime=f"{seconds} seconds")
    return writer.start()


def trigger_seconds_of(given: float | None) -> float:
    """The micro-batch interval: ``given`` (0: each batch starts as soon as the last ends)."""
    if given is None:
        return DEFAULT_TRIGGER_SECONDS
    if given < 0:
        msg = f"trigger_seconds must be 0 or more, got {given}"
        raise ConfigError(msg)
    return given


def await_query(query: Any, pipeline: str, stop: StopRequest, timeout: float | None) -> None:
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
            logged = log_triggers(query, logged)
            if deadline is not None and time.monotonic() > deadline:
                stop.request(f"timeout of {timeout} s")
            if stop.requested and not _trigger_active(query):
                query.stop()
                break
    except KeyboardInterrupt:
        query.stop()
        raise
    error = query.exception() or failure
    if error is not None:
        text = str(error)
        if stop.requested and STOP_MARK in text:
            return  # a micro-batch refused to start: nothing of it ran
        if "FencedError" in text:
            msg = f"pipeline {pipeline!r} was fenced: {text[:500]}"
            raise RunError(msg)
        raise RunError(explain_failure(pipeline, Exception(text), log_file()))


def _trigger_active(query: Any) -> bool:
    """Whether Spark is inside a trigger (planning, running or committing a micro-batch)."""
    try:
        return bool(query.status.get("isTriggerActive", True))
    except Exception:  # noqa: BLE001 - the query just ended: nothing to wait for
        return False


def linger(stop: StopRequest, seconds: float | None) -> None:
    """Keep serving metrics a while after the run, until a signal asks to stop."""
    if not seconds or stop.signals:
        return
    stop.event.clear()
    stop.wait(seconds)
