"""The SparkSession Onceflow runs on, with settings its exactly-once design depends on.

Adaptive query execution is switched off: it may coalesce shuffle partitions, and the runtime
relies on a record's partition being a pure function of its key (backups and keyed state are
stored per partition). Python workers are reused so per-worker caches (Kafka clients, Bloom
filters) survive from task to task.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

REQUIRED_SQL_CONF = {
    "spark.sql.adaptive.enabled": "false",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
}


def spark_session(
    master: str = "local[2]",
    *,
    app_name: str = "onceflow",
    parallelism: int = 2,
    extra_conf: dict[str, str] | None = None,
) -> SparkSession:
    """Get or create the session (local mode by default, any ``--master`` URL works)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        adopt(active)
        return active
    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(parallelism))
        .config("spark.default.parallelism", str(parallelism))
        .config("spark.python.worker.reuse", "true")
        .config("spark.driver.extraJavaOptions", _driver_java_options())
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", "10000")
    )
    for key, value in {**REQUIRED_SQL_CONF, **(extra_conf or {})}.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    logging.getLogger("py4j").setLevel(logging.ERROR)
    return session


LOG4J_CONFIG = os.path.join(os.path.dirname(__file__), "log4j2.properties")


def _driver_java_options() -> str:
    # Fast JVM start (~half the session start time) and errors-only logging.
    jvm = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
    return f"{jvm} -Dlog4j2.configurationFile=file:{LOG4J_CONFIG}"


def adopt(session: SparkSession) -> None:
    """Apply the settings Onceflow needs to a session someone else created."""
    for key, value in REQUIRED_SQL_CONF.items():
        session.conf.set(key, value)
