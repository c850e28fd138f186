"""Bounded runs: every source ends, and the whole job runs as one Spark action.

Each source is read once, the job runs with a progress bar of Spark tasks, and the
:class:`~.result.RunResult` lists records in and out per stage and the dead
letters. State lives in the task's memory; nothing needs Redis.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any

from onceflow.connectors.files import JsonLinesSink
from onceflow.kernel.records import Guarantee
from onceflow.runtime.driver.compile import compile_batch
from onceflow.runtime.driver.placement import check_paths
from onceflow.runtime.driver.progress import TaskProgress
from onceflow.runtime.driver.result import RunResult, explain_failure
from onceflow.runtime.driver.shipping import ship_code
from onceflow.runtime.errors import RunError
from onceflow.runtime.guard import no_guard
from onceflow.runtime.metrics import CounterParam
from onceflow.runtime.spark_env.session import (
    DEFAULT_LOG_LEVEL,
    default_log_file,
    log_file,
    spark_session,
)
from onceflow.runtime.spec import Job

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)


def default_dead_letters(job: Job, output_dir: str) -> Any:
    """Where a bounded run's dead letters go when the pipeline names no sink for them."""
    if job.dead_letters is not None:
        return job.dead_letters
    return JsonLinesSink(os.path.join(output_dir, job.pipeline, "dead-letters.jsonl"))


def all_sinks(job: Job, dead: Any) -> list[Any]:
    """The job's sink connectors and its dead-letter sink, each once."""
    found = list(job.sinks)
    if all(dead is not s for s in found):
        found.append(dead)
    return found


def prepare_sinks(job: Job, dead: Any, streaming: bool, progress: bool) -> list[Any]:
    """Prepare every sink (see :func:`all_sinks`); tell what they found once, at the start.

    Their notes (for example a Kafka cluster that does not replicate the pipeline's topics)
    go to the log and, with ``progress``, to standard error; each distinct note once.
    """
    sinks = all_sinks(job, dead)
    for sink in sinks:
        sink.prepare(job.pipeline, streaming)
    for note in dict.fromkeys(n for sink in sinks for n in sink.notes()):
        log.warning("%s", note)
        if progress:
            print(f"[{job.pipeline}] note: {note}", file=sys.stderr, flush=True)
    return sinks


def run_bounded(
    job: Job,
    *,
    master: str,
    parallelism: int,
    progress: bool,
    session: SparkSession | None,
    output_dir: str,
    code_dir: str | None = None,
    log_level: str = DEFAULT_LOG_LEVEL,
    spark_conf: dict[str, str] | None = None,
) -> RunResult:
    """One Spark action over every source; see the module docstring."""
    spark = session or spark_session(
        master,
        app_name=job.pipeline,
        parallelism=parallelism,
        log_path=default_log_file(job.pipeline, output_dir),
        log_level=log_level,
        extra_conf=spark_conf,
    )
    if code_dir is not None:
        ship_code(spark, code_dir)
    dead = default_dead_letters(job, output_dir)
    job = job.with_dead_letters(dead)
    prepare_sinks(job, dead, False, progress)
    sources = {}
    for name, connector in job.sources:
        connector.prepare(job.pipeline, False)
        sources[name] = connector.frame(spark, parallelism)
    check_paths([c for _, c in job.sources] + all_sinks(job, dead), spark.sparkContext.master)
    metrics = spark.sparkContext.accumulator({}, CounterParam())
    started = time.monotonic()
    compiled = compile_batch(
        job, spark, sources, no_guard, batch=0, parallelism=parallelism, metrics=metrics
    )
    group = f"onceflow-{job.pipeline}-{uuid.uuid4().hex[:8]}"
    try:
        with TaskProgress(spark.sparkContext, group, enabled=progress):
            compiled.run()
    except Exception as exc:
        raise RunError(explain_failure(job.pipeline, exc, log_file())) from exc
    for sink in all_sinks(job, dead):
        sink.finish()
    return RunResult(
        pipeline=job.pipeline,
        job=job,
        mode=Guarantee.BOUNDED,
        seconds=time.monotonic() - started,
        counters=dict(metrics.value),
        dead_letter_sink=dead.describe(),
    )
