"""Apache Kafka's jars for :class:`~onceflow.testing.kafka.LocalKafka`, and a Java to run them.

``fetch_kafka()`` brings the broker's jars from Maven Central (once, through ``mvn``) into a
cache directory; ``java_binary()`` finds a Java new enough for them.

**Version.** ``KAFKA_VERSION`` is 4.4.0, the newest release on Maven Central when this was
written: Kafka 4.x is KRaft only (no ZooKeeper), its broker needs Java 17 or newer (checked:
no class in the 4.4.0 jars or their dependencies targets more than Java 17) and Kafka 4.0 and
later accept the protocol versions that kafka-python 3 speaks. Kafka's jars on Maven Central
name no logging backend (the binary distribution adds one), so the fetch adds Log4j 2
(``log4j-core`` and the SLF4J 1.x binding ``log4j-slf4j-impl``, since Kafka logs through
``slf4j-api`` 1.7): the broker then logs through a configuration written next to its data.

**Cache.** ``~/.cache/onceflow/kafka-<version>/libs/`` holds the jars (about 45 jars, 43 MB
for 4.4.0), reused across runs. Set ``ONCEFLOW_KAFKA_HOME`` to use another directory: the jars
are read from (or downloaded into) its ``libs/`` folder, whatever version that holds (the
layout of an unpacked Apache Kafka binary distribution). A download goes into a temporary
folder renamed into place once complete, under a lock file: two processes fetching at once
download once, and an interrupted download leaves nothing half-done behind.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from onceflow.connectors import maven
from onceflow.kernel.errors import ServiceError

KAFKA_VERSION = "4.4.0"
SCALA_VERSION = "2.13"
# The logging backend Kafka's Maven metadata leaves out: Log4j 2 behind SLF4J 1.7 (the
# slf4j-api version Kafka 4.4 depends on), hence log4j-slf4j-impl, not log4j-slf4j2-impl.
LOG4J_VERSION = "2.25.5"
# Pinned so that the download does not depend on the plugin version Maven happens to default to.
HOME_ENV = "ONCEFLOW_KAFKA_HOME"
DEFAULT_CACHE = Path("~/.cache/onceflow")
MIN_JAVA = 17


def kafka_home(version: str = KAFKA_VERSION) -> Path:
    """Where the jars of ``version`` live: ``$ONCEFLOW_KAFKA_HOME`` or the user's cache."""
    override = os.environ.get(HOME_ENV)
    if override:
        return Path(override).expanduser()
    return DEFAULT_CACHE.expanduser() / f"kafka-{version}"


def _has_jars(libs: Path) -> bool:
    return any(libs.glob("kafka_*.jar"))


def fetch_kafka(version: str = KAFKA_VERSION) -> Path:
    """The folder whose ``libs/`` holds Kafka ``version`` and its runtime jars; fetched once.

    Downloads with ``mvn dependency:copy-dependencies`` when the jars are missing (see the
    module docstring for the cache and ``ONCEFLOW_KAFKA_HOME``). Safe to call concurrently.
    """
    home = kafka_home(version)
    libs = home / "libs"
    if _has_jars(libs):
        return home
    mvn = shutil.which("mvn")
    if mvn is None:
        msg = (
            f"Apache Kafka {version} is not in {libs} and Maven ('mvn') is not installed to "
            f"fetch it; install Maven (apt-get install maven) or set {HOME_ENV} to a folder "
            "whose libs/ holds the Kafka jars (the layout of an unpacked Kafka distribution)"
        )
        raise ServiceError(msg)
    home.mkdir(parents=True, exist_ok=True)
    with maven.locked(home / ".fetch.lock"):
        if not _has_jars(libs):  # another process may have fetched it while we waited
            _download(mvn, version, libs)
    return home


def _download(mvn: str, version: str, libs: Path) -> None:
    """Copy the runtime jars into a temporary sibling of ``libs``, then rename it into place."""
    print(
        f"onceflow: fetching Apache Kafka {version} jars from Maven Central into {libs} (once)",
        file=sys.stderr,
    )
    partial = libs.with_name(f".libs.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    deps = [
        ("org.apache.kafka", f"kafka_{SCALA_VERSION}", version),
        ("org.apache.logging.log4j", "log4j-core", LOG4J_VERSION),
        ("org.apache.logging.log4j", "log4j-slf4j-impl", LOG4J_VERSION),
    ]
    cmd, done = maven.copy_dependencies(mvn, "kafka-jars", deps, partial)
    if done is None or done.returncode != 0 or not _has_jars(partial):
        shutil.rmtree(partial, ignore_errors=True)
        msg = (
            f"could not fetch Apache Kafka {version} from Maven Central with {' '.join(cmd)} "
            f"(expected its jars in {partial}); check that Maven reaches Central (a proxy or "
            f"mirror in ~/.m2/settings.xml), or set {HOME_ENV} to a folder whose libs/ holds "
            f"the Kafka jars. Maven said:\n{maven.maven_errors(done)}"
        )
        raise ServiceError(msg)
    try:
        partial.rename(libs)
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        msg = (
            f"fetched Apache Kafka {version} but could not move it to {libs} ({exc}); expected "
            f"{libs} to be absent or to hold kafka_*.jar: remove it and try again"
        )
        raise ServiceError(msg) from exc


@functools.cache
def java_binary() -> str:
    """The ``java`` to run Kafka with (``$JAVA_HOME/bin/java`` or PATH), checked to be >= 17."""
    java_home = os.environ.get("JAVA_HOME")
    exe = os.path.join(java_home, "bin", "java") if java_home else shutil.which("java")
    if exe is None or not os.access(exe, os.X_OK):
        msg = (
            f"Apache Kafka needs Java {MIN_JAVA} or newer and no 'java' was found "
            f"(JAVA_HOME={java_home!r}); install it (apt-get install openjdk-17-jre-headless)"
        )
        raise ServiceError(msg)
    out = subprocess.run([exe, "-version"], capture_output=True, text=True, check=False)
    found = re.search(r'version "(\d+)', out.stderr)
    if found is None or int(found.group(1)) < MIN_JAVA:
        msg = (
            f"Apache Kafka needs Java {MIN_JAVA} or newer; {exe} reports "
            f"{out.stderr.strip().splitlines()[:1]}; install openjdk-17-jre-headless or set "
            "JAVA_HOME to a newer Java"
        )
        raise ServiceError(msg)
    return exe
