"""Kafka Connect with Debezium's PostgreSQL connector, for the CDC tests and benchmarks.

``LocalDebezium`` runs Apache Kafka Connect in standalone mode (``ConnectStandalone``, the
worker of Apache Kafka 4.3, the release Debezium 3.6.1 is built against; its jars from Maven
Central)
with one connector: Debezium's PostgreSQL connector (``io.debezium:debezium-connector-postgres``
3.6.1.Final, loaded from ``plugin.path`` as Connect isolates plugins), reading a database of a
:class:`~onceflow.testing.postgres.LocalPostgres` through ``pgoutput`` into topics named
``<prefix>.<schema>.<table>``. Converters are Kafka Connect's ``JsonConverter``, with schemas
(the default a user gets; the decoder unwraps them).

Connect keeps the connector's source offsets in a file in ``directory``, flushed every
:data:`OFFSET_FLUSH_MS`: ``kill()`` then ``start()`` resumes from the last flushed offset and
re-sends what came after it, the way a real Connect restart does.

**Cache.** ``~/.cache/onceflow/kafka-connect-<kafka>-debezium-<debezium>/`` holds ``libs/``
(the Connect runtime and Log4j 2) and ``plugins/debezium-postgres/``; fetched once with ``mvn``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from onceflow.connectors import maven
from onceflow.kernel.errors import ServiceError
from onceflow.testing.kafka_config import LOG4J2_PROPERTIES, java_command
from onceflow.testing.kafka_jars import DEFAULT_CACHE, LOG4J_VERSION
from onceflow.testing.services import free_port, track_process

DEBEZIUM_VERSION = "3.6.1.Final"
# Kafka Connect of the Kafka release Debezium 3.6.1 is built against (its kafka-clients): the
# 4.4.0 runtime the broker uses no longer has a class the connector loads from it (Sanitizer).
# Connect 4.3 talks to the 4.4 broker like any client.
CONNECT_VERSION = "4.3.0"
CONNECT_MAIN = "org.apache.kafka.connect.cli.ConnectStandalone"
OFFSET_FLUSH_MS = 1000
START_TIMEOUT_S = 120.0
HEAP = "384m"
# Jars Connect's own class path provides: a plugin's copies of them would shadow the API types
_PROVIDED = ("connect-api-", "kafka-clients-", "slf4j-api-")


def connect_home() -> Path:
    """Where the Connect runtime and the Debezium plugin are cached."""
    return (
        DEFAULT_CACHE.expanduser() / f"kafka-connect-{CONNECT_VERSION}-debezium-{DEBEZIUM_VERSION}"
    )


def fetch_connect() -> Path:
    """The cache folder with ``libs/`` and ``plugins/debezium-postgres/``, fetched once."""
    home = connect_home()
    libs, plugin = home / "libs", home / "plugins" / "debezium-postgres"
    if any(libs.glob("connect-runtime-*.jar")) and any(plugin.glob("debezium-connector-*.jar")):
        return home
    mvn = shutil.which("mvn")
    if mvn is None:
        msg = "Kafka Connect and Debezium come from Maven Central: apt-get install maven"
        raise ServiceError(msg)
    home.mkdir(parents=True, exist_ok=True)
    with maven.locked(home / ".fetch.lock"):
        log4j = [
            ("org.apache.logging.log4j", "log4j-core", LOG4J_VERSION),
            ("org.apache.logging.log4j", "log4j-slf4j-impl", LOG4J_VERSION),
        ]
        runtime = [
            ("org.apache.kafka", "connect-runtime", CONNECT_VERSION),
            ("org.apache.kafka", "connect-json", CONNECT_VERSION),
            *log4j,
        ]
        debezium = [("io.debezium", "debezium-connector-postgres", DEBEZIUM_VERSION)]
        _fetch(mvn, "connect-jars", runtime, libs, "connect-runtime-")
        _fetch(mvn, "debezium-jars", debezium, plugin, "debezium-connector-")
        for jar in plugin.glob("*.jar"):
            if jar.name.startswith(_PROVIDED):
                jar.unlink()
    return home


def _fetch(mvn: str, name: str, deps: list[tuple[str, str, str]], into: Path, marker: str) -> None:
    if any(into.glob(f"{marker}*.jar")):
        return
    print(f"onceflow: fetching {name} from Maven Central into {into} (once)", file=sys.stderr)
    partial = into.with_name(f".{into.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    cmd, done = maven.copy_dependencies(mvn, name, deps, partial)
    if done is None or done.returncode != 0 or not any(partial.glob(f"{marker}*.jar")):
        shutil.rmtree(partial, ignore_errors=True)
        msg = f"could not fetch {name} with {' '.join(cmd)}:\n{maven.maven_errors(done)}"
        raise ServiceError(msg)
    into.parent.mkdir(parents=True, exist_ok=True)
    partial.rename(into)


class LocalDebezium:
    """Kafka Connect (standalone) running Debezium's PostgreSQL connector on one database.

    ``database``: ``(host, port, dbname, user, password)``; ``tables``: the tables to capture
    (``schema.table``); ``prefix``: the topics' prefix (Debezium's ``topic.prefix``);
    ``connector``: more connector properties; ``flush_ms``: how often Connect stores the
    connector's offsets (a kill re-sends what came after the last store). The replication
    slot and the publication are named after the prefix.
    """

    def __init__(
        self,
        bootstrap: str,
        database: tuple[str, int, str, str, str],
        tables: list[str],
        prefix: str = "cdc",
        connector: Mapping[str, str] | None = None,
        directory: str | None = None,
        flush_ms: int = OFFSET_FLUSH_MS,
    ) -> None:
        self.bootstrap = bootstrap
        self.database = database
        self.tables = tables
        self.prefix = prefix
        self.extra = dict(connector or {})
        self.flush_ms = flush_ms
        self._owns_directory = directory is None
        self.directory = directory or tempfile.mkdtemp(prefix="onceflow-connect-")
        self.rest_port = free_port()
        self.log_path = os.path.join(self.directory, "connect.log")
        self.proc: subprocess.Popen[bytes] | None = None

    def topic(self, table: str) -> str:
        """The topic of ``schema.table``."""
        return f"{self.prefix}.{table}"

    def _write_config(self) -> tuple[Path, str, str, str]:
        home = fetch_connect()
        worker = {
            "bootstrap.servers": self.bootstrap,
            "key.converter": "org.apache.kafka.connect.json.JsonConverter",
            "value.converter": "org.apache.kafka.connect.json.JsonConverter",
            "offset.storage.file.filename": os.path.join(self.directory, "offsets"),
            "offset.flush.interval.ms": str(self.flush_ms),
            "plugin.path": str(home / "plugins"),
            "listeners": f"http://127.0.0.1:{self.rest_port}",
        }
        host, port, dbname, user, password = self.database
        slot = self.prefix.replace("-", "_").replace(".", "_")
        connector = {
            "name": f"{self.prefix}-source",
            "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
            "tasks.max": "1",
            "database.hostname": host,
            "database.port": str(port),
            "database.user": user,
            "database.password": password,
            "database.dbname": dbname,
            "topic.prefix": self.prefix,
            "plugin.name": "pgoutput",
            "slot.name": f"{slot}_slot",
            "publication.name": f"{slot}_pub",
            "publication.autocreate.mode": "filtered",
            "table.include.list": ",".join(self.tables),
            "decimal.handling.mode": "string",
            "snapshot.mode": "initial",
            **self.extra,
        }
        paths = []
        for name, props in (("worker", worker), ("connector", connector)):
            path = os.path.join(self.directory, f"{name}.properties")
            Path(path).write_text("".join(f"{k}={v}\n" for k, v in props.items()), "utf-8")
            paths.append(path)
        log4j = os.path.join(self.directory, "log4j2.properties")
        Path(log4j).write_text(LOG4J2_PROPERTIES, encoding="utf-8")
        return home, paths[0], paths[1], log4j

    def start(self) -> LocalDebezium:
        """Start Connect and wait until the connector's task runs."""
        if self.running:
            return self
        home, worker, connector, log4j = self._write_config()
        cmd = java_command(home, HEAP, log4j, CONNECT_MAIN, worker, connector)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it
        self.proc = track_process(
            subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
        )
        self._wait_running()
        return self

    def status(self) -> dict[str, Any] | None:
        """The connector's status from Connect's REST API (None: not answering yet)."""
        url = f"http://127.0.0.1:{self.rest_port}/connectors/{self.prefix}-source/status"
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:  # noqa: S310 - loopback
                return json.loads(reply.read())  # type: ignore[no-any-return]
        except OSError:
            return None

    def _wait_running(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if not self.running:
                break
            status = self.status()
            tasks = status.get("tasks", []) if status else []
            states = [t.get("state") for t in tasks]
            if "FAILED" in states:
                break
            if states and all(s == "RUNNING" for s in states):
                return
            time.sleep(0.2)
        tail = Path(self.log_path).read_text("utf-8", "replace").splitlines()[-30:]
        self.kill()
        msg = f"Kafka Connect did not start Debezium; see {self.log_path}:\n" + "\n".join(tail)
        raise ServiceError(msg)

    @property
    def running(self) -> bool:
        """Whether the worker's process is alive."""
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """The worker killed with -9 (offsets not flushed since the last flush are lost)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        """A clean stop (SIGTERM: Connect flushes its offsets)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> LocalDebezium:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        if self._owns_directory and exc_type is None:
            shutil.rmtree(self.directory, ignore_errors=True)
