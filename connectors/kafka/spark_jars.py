"""Spark's Kafka connector's jars: fetched once from Maven Central, put on a session's classpath.

**Jars.** Spark's PyPI wheel ships no Kafka connector, and Maven Central holds it only up to
:data:`CONNECTOR_VERSION` (4.2.0; none for Spark 4.3.0 yet). That build loads and runs on
PySpark 4.3.0 (measured: batch and streaming reads, ``availableNow``, restarts from the
checkpoint, transactions under ``read_committed``). :func:`fetch_connector` brings it with
its dependencies from Maven Central once, through ``mvn``, into
``~/.cache/onceflow/spark-kafka-<version>/jars`` (or ``$ONCEFLOW_SPARK_KAFKA_JARS``), the way
:mod:`onceflow.testing.kafka_jars` fetches the broker. :func:`connector_jars` leaves out the jars
Spark already ships (Hadoop, Scala, compression, SLF4J ...): what remains is the connector,
its token provider, ``kafka-clients`` and ``commons-pool2``. The jars must be on the
classpath *when the session starts* (``spark.jars``); :func:`session_conf` says which setting
a session needs for a pipeline's sources.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

from onceflow.connectors import maven
from onceflow.kernel.errors import ServiceError

SPARK_CLIENT = "spark"  # KafkaSource(client=...) reading through Spark's own connector
JARS_CONF = "spark.jars"
CONNECTOR_VERSION = "4.2.0"  # the newest spark-sql-kafka-0-10 on Maven Central (Spark 4.3.0: none)
SCALA_VERSION = "2.13"
CONNECTOR_GROUP = "org.apache.spark"
CONNECTOR_ARTIFACT = f"spark-sql-kafka-0-10_{SCALA_VERSION}"
# Pinned so that the download does not depend on the plugin version Maven happens to default to.
JARS_ENV = "ONCEFLOW_SPARK_KAFKA_JARS"
DEFAULT_CACHE = Path("~/.cache/onceflow")
_JAR_VERSION = re.compile(r"-\d[^-]*(-[A-Za-z][\w.]*)?\.jar$")  # "-3.9.2.jar", "-2.0-M1.jar"


def connector_home(version: str = CONNECTOR_VERSION) -> Path:
    """Where the connector's jars live: ``$ONCEFLOW_SPARK_KAFKA_JARS`` or the user's cache."""
    override = os.environ.get(JARS_ENV)
    if override:
        return Path(override).expanduser()
    return DEFAULT_CACHE.expanduser() / f"spark-kafka-{version}" / "jars"


def _has_connector(folder: Path) -> bool:
    return any(folder.glob(f"{CONNECTOR_ARTIFACT}-*.jar"))


def fetch_connector(version: str = CONNECTOR_VERSION) -> Path:
    """The folder holding the connector ``version`` and its runtime jars; fetched once.

    Downloads with ``mvn dependency:copy-dependencies`` into a temporary sibling renamed into
    place when complete, under a lock file (concurrent callers download once). Set
    ``ONCEFLOW_SPARK_KAFKA_JARS`` to a folder that already holds the jars to skip Maven.
    """
    folder = connector_home(version)
    if _has_connector(folder):
        return folder
    mvn = shutil.which("mvn")
    if mvn is None:
        msg = (
            f"Spark's Kafka connector {version} is not in {folder} and Maven ('mvn') is not "
            f"installed to fetch it; install Maven (apt-get install maven), set {JARS_ENV} to a "
            f"folder holding {CONNECTOR_ARTIFACT}-{version}.jar and its dependencies, or use "
            "KafkaSource(client='python')"
        )
        raise ServiceError(msg)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with maven.locked(folder.parent / ".fetch.lock"):
        if not _has_connector(folder):  # another process may have fetched it while we waited
            _download(mvn, version, folder)
    return folder


def _download(mvn: str, version: str, folder: Path) -> None:
    """Copy the runtime jars into a temporary sibling of ``folder``, then rename it into place."""
    print(
        f"onceflow: fetching Spark's Kafka connector {version} from Maven Central into "
        f"{folder} (once)",
        file=sys.stderr,
    )
    partial = folder.with_name(f".jars.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    deps = [(CONNECTOR_GROUP, CONNECTOR_ARTIFACT, version)]
    cmd, done = maven.copy_dependencies(mvn, "spark-kafka-jars", deps, partial)
    if done is None or done.returncode != 0 or not _has_connector(partial):
        shutil.rmtree(partial, ignore_errors=True)
        msg = (
            f"could not fetch Spark's Kafka connector {version} from Maven Central with "
            f"{' '.join(cmd)} (expected {CONNECTOR_ARTIFACT}-{version}.jar in {partial}); check "
            f"that Maven reaches Central (a proxy or mirror in ~/.m2/settings.xml), set "
            f"{JARS_ENV} to a folder holding the jars, or use KafkaSource(client='python'). "
            f"Maven said:\n{maven.maven_errors(done)}"
        )
        raise ServiceError(msg)
    try:
        partial.rename(folder)
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        msg = (
            f"fetched Spark's Kafka connector {version} but could not move it to {folder} "
            f"({exc}); expected {folder} to be absent or to hold the jars: remove it and retry"
        )
        raise ServiceError(msg) from exc


def artifact_name(jar: str) -> str:
    """A jar's artifact without its version: ``kafka-clients-3.9.2.jar`` -> ``kafka-clients``."""
    return _JAR_VERSION.sub("", os.path.basename(jar))


def spark_jars_folder() -> Path:
    """The jars folder of the installed PySpark (what every session already loads)."""
    import pyspark

    return Path(pyspark.__file__).parent / "jars"


def connector_jars(version: str = CONNECTOR_VERSION) -> list[str]:
    """Paths of the jars a session needs for ``format("kafka")``, fetched if missing.

    The fetched jars minus every artifact the installed PySpark ships in another version
    (Spark's own copy wins: two versions of a class on one classpath is a lottery).
    """
    shipped = {artifact_name(j.name) for j in spark_jars_folder().glob("*.jar")}
    jars = sorted(fetch_connector(version).glob("*.jar"))
    return [str(j) for j in jars if artifact_name(j.name) not in shipped]


def uses_spark_client(connectors: Iterable[object]) -> bool:
    """Whether any of ``connectors`` is a Kafka source with ``client="spark"``."""
    return any(getattr(c, "client", None) == SPARK_CLIENT for c in connectors)


def session_conf(connectors: Iterable[object], existing_jars: str | None = None) -> dict[str, str]:
    """The session settings these sources need: ``spark.jars`` when one reads with Spark.

    Empty when no source has ``client="spark"`` (the jars are neither fetched nor loaded).
    ``existing_jars`` is a ``spark.jars`` value the caller already sets; it is kept first.
    """
    if not uses_spark_client(connectors):
        return {}
    jars = [j for j in (existing_jars or "").split(",") if j]
    jars += [j for j in connector_jars() if j not in jars]
    return {JARS_CONF: ",".join(jars)}
