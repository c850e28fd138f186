"""Running a job: bounded when every source ends, else a streaming query."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from onceflow.kernel.errors import ConfigError
from onceflow.runtime.bounded import run_bounded
from onceflow.runtime.result import RunResult
from onceflow.runtime.session import DEFAULT_LOG_LEVEL
from onceflow.runtime.spec import Job

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DEFAULT_OUTPUT_DIR = "onceflow-output"


def run(
    job: Job,
    *,
    master: str = "local[2]",
    parallelism: int = 2,
    progress: bool = True,
    session: SparkSession | None = None,
    output_dir: str = DEFAULT_OUTPUT_DIR,
    code_dir: str | None = None,
    log_level: str = DEFAULT_LOG_LEVEL,
    spark_conf: dict[str, str] | None = None,
    **streaming: Any,
) -> RunResult:
    """Run ``job``: one Spark action when it is bounded, else a streaming query.

    ``code_dir`` is the folder of the user's own modules to ship to the workers (the
    pipeline file's folder, for ``onceflow run``). ``log_level`` and ``spark_conf`` apply when
    the run starts the session (see :func:`onceflow.runtime.session.spark_session`). Streaming
    settings (Redis, checkpoint, trigger, guarantee, metrics ...) are described in
    :func:`onceflow.runtime.streaming.run_streaming`.
    """
    if not job.bounded:
        from onceflow.runtime.streaming import run_streaming

        return run_streaming(
            job,
            session=session,
            master=master,
            parallelism=parallelism,
            progress=progress,
            output_dir=output_dir,
            code_dir=code_dir,
            log_level=log_level,
            spark_conf=spark_conf,
            **streaming,
        )
    if streaming:
        names = ", ".join(sorted(streaming))
        msg = f"settings {names} only apply to streaming runs; every source here is bounded"
        raise ConfigError(msg)
    return run_bounded(
        job,
        master=master,
        parallelism=parallelism,
        progress=progress,
        session=session,
        output_dir=output_dir,
        code_dir=code_dir,
        log_level=log_level,
        spark_conf=spark_conf,
    )
