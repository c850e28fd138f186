"""Running a job: bounded when every source ends, else a streaming query."""

from __future__ import annotations

from typing import TYPE_CHECKING

from onceflow.kernel import record_types
from onceflow.kernel.errors import ConfigError
from onceflow.runtime.driver.bounded import run_bounded
from onceflow.runtime.driver.result import RunResult
from onceflow.runtime.driver.run_config import RunConfig
from onceflow.runtime.spec import Job

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def run(job: Job, config: RunConfig, session: SparkSession | None = None) -> RunResult:
    """Run ``job``: one Spark action when it is bounded, else a streaming query.

    ``config`` holds every setting (see :class:`~.run_config.RunConfig`);
    ``session`` is a SparkSession to run on instead of starting one (then ``log_level`` and
    ``spark_conf`` do not apply). A bounded job refuses settings only a streaming run reads.
    """
    for stage in job.stages:  # what the driver reads back (to_driver sinks, dead letters)
        record_types.register(stage.record_types)
    if not job.bounded:
        from onceflow.runtime.driver.streaming import run_streaming

        return run_streaming(job, config, session)
    streaming = config.streaming_settings()
    if streaming:
        names = ", ".join(sorted(streaming))
        msg = f"settings {names} only apply to streaming runs; every source here is bounded"
        raise ConfigError(msg)
    return run_bounded(
        job,
        master=config.master,
        parallelism=config.parallelism,
        progress=config.progress,
        session=session,
        output_dir=config.output_dir,
        code_dir=config.code_dir,
        log_level=config.log_level,
        spark_conf=config.spark_conf,
    )
