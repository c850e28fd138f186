"""A real Apache Kafka broker on loopback, for the tests, the benchmarks and the demo.

``LocalKafka`` runs the jars that :func:`~onceflow.testing.kafka_jars.fetch_kafka` brings from
Maven Central as a single-node KRaft cluster (one JVM with the broker and controller roles)
on free loopback ports, with settings for one node and for tests (replication factor 1
everywhere, no initial rebalance delay, quick retention checks: see
:mod:`onceflow.testing.kafka_config`). Several nodes: :mod:`onceflow.testing.kafka_cluster`.

Why a real Kafka beside the ``tansu`` broker of ``onceflow.testing.services``: tansu reports
wrong end offsets, lets ``read_committed`` consumers see aborted transactions and has no
``delete_records`` or ``create_partitions``. Kafka has none of those differences; it costs a
JVM (~300 MB resident) and a few seconds to start instead of ~30 ms.

>>> with LocalKafka() as kafka:
...     producer = KafkaProducer(bootstrap_servers=kafka.bootstrap)
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

from onceflow.kernel.errors import ServiceError
from onceflow.testing.kafka_config import (
    DEFAULT_HEAP,
    LOG4J2_PROPERTIES,
    LOOPBACK,
    MAIN_CLASS,
    NODE_ID,
    STORAGE_TOOL_CLASS,
    broker_properties,
    java_command,
    new_cluster_id,
)
from onceflow.testing.kafka_jars import KAFKA_VERSION, fetch_kafka
from onceflow.testing.services import free_port, track_process

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0
KILL_TIMEOUT_S = 10.0
FORMAT_TIMEOUT_S = 120.0
PROBE_TIMEOUT_MS = 3000
POLL_INTERVAL_S = 0.1
PORT_ATTEMPTS = 5
LOG_TAIL_LINES = 25


def _other_port(taken: int) -> int:
    port = free_port()
    while port == taken:
        port = free_port()
    return port


def broker_answers(port: int, node_id: int, cluster_id: str | None) -> bool:
    """Whether the broker on ``port`` is node ``node_id`` of ``cluster_id``, and unfenced.

    Raises when the port does not answer yet, or when another cluster's broker holds it.
    """
    bootstrap = f"{LOOPBACK}:{port}"
    with socket.create_connection((LOOPBACK, port), POLL_INTERVAL_S * 5):
        pass
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(
        bootstrap_servers=bootstrap,
        request_timeout_ms=PROBE_TIMEOUT_MS,
        connections_max_idle_ms=PROBE_TIMEOUT_MS * 10,
    )
    try:
        cluster = admin.describe_cluster()
    finally:
        admin.close()
    live = [b.get("broker_id") for b in cluster.get("brokers", []) if not b.get("is_fenced")]
    if cluster.get("cluster_id") != cluster_id:
        msg = (
            f"the broker on {bootstrap} belongs to cluster {cluster.get('cluster_id')}, "
            f"expected {cluster_id}: another process has the port"
        )
        raise ServiceError(msg)
    return node_id in live


class LocalKafka:
    """A single-node Apache Kafka (KRaft) on loopback, with its data in ``directory``.

    The first ``start()`` formats the storage (a new cluster id); ``restart()`` keeps the
    directory and both ports, so clients reconnect to the same ``bootstrap``. ``properties``
    overrides or adds broker settings. Leaving a ``with`` block stops the broker and, unless
    the block raised, deletes the temporary directory it made (a given one is kept).

    Measured on two busy cores: first start with the format ~3.5-6 s; a restart after
    ``stop()`` ~2.6-4.5 s; after ``kill()`` ~5-7.5 s, as the controller first waits out the
    dead broker's registration (``broker.session.timeout.ms``); ``stop()`` ~0.3-0.5 s.
    The JVM's resident size is ~280 MB.
    """

    def __init__(
        self,
        directory: str | None = None,
        port: int | None = None,
        controller_port: int | None = None,
        version: str = KAFKA_VERSION,
        properties: Mapping[str, str] | None = None,
        *,
        node_id: int = NODE_ID,
        voters: str | None = None,
        cluster_id: str | None = None,
        heap: str = DEFAULT_HEAP,
    ) -> None:
        self._owns_directory = directory is None
        self.node_id = node_id
        self.voters = voters  # the controller quorum, when this node is one of a cluster
        self.new_cluster_id = cluster_id  # the id the format step writes (None: a new one)
        self.heap = heap
        self.directory = directory or tempfile.mkdtemp(prefix="onceflow-kafka-")
        self.port = port or free_port()
        self.controller_port = controller_port or _other_port(self.port)
        self.version = version
        self.overrides = dict(properties or {})
        self.log_path = os.path.join(self.directory, "kafka.log")
        self.proc: subprocess.Popen[bytes] | None = None
        self._fixed_ports = port is not None or controller_port is not None

    @property
    def bootstrap(self) -> str:
        """``127.0.0.1:PORT``."""
        return f"{LOOPBACK}:{self.port}"

    @property
    def data_dir(self) -> str:
        """The broker's ``log.dirs`` (topic data and the KRaft metadata log)."""
        return os.path.join(self.directory, "data")

    @property
    def cluster_id(self) -> str | None:
        """The id written by the format step, or None before the first start."""
        meta = Path(self.data_dir, "meta.properties")
        if not meta.exists():
            return None
        for line in meta.read_text(encoding="utf-8").splitlines():
            if line.startswith("cluster.id="):
                return line.partition("=")[2].strip()
        return None

    def start(self) -> LocalKafka:
        """Start (formatting the storage the first time) and wait until the broker answers."""
        if self.running:
            return self
        first = self.cluster_id is None
        attempts = PORT_ATTEMPTS if first and not self._fixed_ports else 1
        for attempt in range(attempts):
            self.launch()
            try:
                self._wait_ready()
                return self
            except ServiceError:
                self.kill()
                if attempt + 1 == attempts or not self._port_taken():
                    raise
                self.port = free_port()
                self.controller_port = _other_port(self.port)
        msg = f"Kafka did not start; see {self.log_path}"  # not reached: the loop raises
        raise ServiceError(msg)

    def launch(self) -> None:
        """Start the JVM (formatting the storage the first time) without waiting for it.

        The nodes of a cluster are launched together: a controller quorum needs a majority
        of its voters up before any broker of it answers.
        """
        if self.running:
            return
        home = fetch_kafka(self.version)
        self._write_config()
        if self.cluster_id is None:
            self._format(home)
        self._launch(home)

    def wait_ready(self) -> None:
        """Until the broker answers (see :meth:`_wait_ready`); kills it if it does not."""
        try:
            self._wait_ready()
        except ServiceError:
            self.kill()
            raise

    @property
    def running(self) -> bool:
        """Whether the broker's process is alive (it may be paused)."""
        return self.proc is not None and self.proc.poll() is None

    def _config_path(self) -> str:
        return os.path.join(self.directory, "server.properties")

    def _log4j_path(self) -> str:
        return os.path.join(self.directory, "log4j2.properties")

    def _write_config(self) -> None:
        os.makedirs(self.data_dir, exist_ok=True)
        props = {
            **broker_properties(
                self.port, self.controller_port, self.data_dir, self.node_id, self.voters
            ),
            **self.overrides,
        }
        text = "".join(f"{k}={v}\n" for k, v in props.items())
        Path(self._config_path()).write_text(text, encoding="utf-8")
        Path(self._log4j_path()).write_text(LOG4J2_PROPERTIES, encoding="utf-8")

    def _java(self, home: Path, main: str, *args: str) -> list[str]:
        return java_command(home, self.heap, self._log4j_path(), main, *args)

    def _format(self, home: Path) -> None:
        cluster = self.new_cluster_id or new_cluster_id()
        cmd = self._java(
            home, STORAGE_TOOL_CLASS, "format", "-t", cluster, "-c", self._config_path()
        )
        with open(self.log_path, "ab") as log:
            done = subprocess.run(
                cmd, stdout=log, stderr=log, timeout=FORMAT_TIMEOUT_S, check=False
            )
        if done.returncode != 0:
            msg = (
                f"formatting Kafka's storage in {self.data_dir} failed (exit status "
                f"{done.returncode}); expected a new single-node KRaft cluster. See "
                f"{self.log_path}:\n{self.log_tail()}"
            )
            raise ServiceError(msg)

    def _launch(self, home: Path) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps the descriptor
        try:
            self.proc = track_process(
                subprocess.Popen(
                    self._java(home, MAIN_CLASS, self._config_path()),
                    stdout=log,
                    stderr=log,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        finally:
            log.close()

    def _wait_ready(self) -> None:
        """Until a metadata request lists this broker and this cluster's id."""
        deadline = time.monotonic() + START_TIMEOUT_S
        last = "no answer yet"
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                msg = (
                    f"Kafka exited with status {code} before answering on {self.bootstrap}; "
                    f"see {self.log_path}:\n{self.log_tail()}"
                )
                raise ServiceError(msg)
            try:
                if broker_answers(self.port, self.node_id, self.cluster_id):
                    return
                last = f"broker {self.node_id} not yet registered and unfenced"
            except Exception as exc:  # noqa: BLE001 - any failure means "not ready yet"
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(POLL_INTERVAL_S)
        msg = (
            f"Kafka did not answer on {self.bootstrap} within {START_TIMEOUT_S:.0f} s "
            f"(last: {last}); see {self.log_path}:\n{self.log_tail()}"
        )
        raise ServiceError(msg)

    def _port_taken(self) -> bool:
        text = Path(self.log_path).read_text(encoding="utf-8", errors="replace")
        return "Address already in use" in text

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last lines of the broker's log."""
        try:
            text = Path(self.log_path).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """Shut down cleanly (SIGTERM), SIGKILL if that takes over ``STOP_TIMEOUT_S``."""
        if self.proc is not None and self.proc.poll() is None:
            self.resume()  # a paused JVM cannot handle SIGTERM
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(KILL_TIMEOUT_S)

    def restart(self, kill: bool = True) -> None:
        """Kill (or stop) and start again on the same directory and ports."""
        if kill:
            self.kill()
        else:
            self.stop()
        self.start()

    def pause(self) -> None:
        """Freeze the broker (SIGSTOP): it keeps its connections but answers nothing."""
        if self.running and self.proc is not None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Unfreeze the broker (SIGCONT)."""
        if self.running and self.proc is not None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def __enter__(self) -> LocalKafka:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        if self._owns_directory and exc_type is None:  # keep the log when something failed
            shutil.rmtree(self.directory, ignore_errors=True)
