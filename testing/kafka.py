"""A real Apache Kafka broker on loopback, for the tests, the benchmarks and the demo.

``fetch_kafka()`` brings the broker's jars from Maven Central (once, through ``mvn``) into a
cache directory; ``LocalKafka`` runs them as a single-node KRaft cluster (one JVM with the
broker and controller roles) on free loopback ports, with settings for one node and for tests
(replication factor 1 everywhere, no initial rebalance delay, quick retention checks).

Why a real Kafka beside the ``tansu`` broker of ``onceflow.testing.services``: tansu reports
wrong end offsets, lets ``read_committed`` consumers see aborted transactions and has no
``delete_records`` or ``create_partitions``. Kafka has none of those differences; it costs a
JVM (~300 MB resident) and a few seconds to start instead of ~30 ms.

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

**A cluster.** ``LocalKafkaCluster(brokers=3)`` runs three such nodes, each broker and
controller, with replication factor 3 and ``min.insync.replicas`` 2, and kills, stops and
restarts one node at a time (a rolling restart, for the broker-restart tests).

>>> with LocalKafka() as kafka:
...     producer = KafkaProducer(bootstrap_servers=kafka.bootstrap)
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

from onceflow.kernel.errors import ServiceError
from onceflow.testing.services import free_port, track_process

KAFKA_VERSION = "4.4.0"
SCALA_VERSION = "2.13"
# The logging backend Kafka's Maven metadata leaves out: Log4j 2 behind SLF4J 1.7 (the
# slf4j-api version Kafka 4.4 depends on), hence log4j-slf4j-impl, not log4j-slf4j2-impl.
LOG4J_VERSION = "2.25.5"
# Pinned so that the download does not depend on the plugin version Maven happens to default to.
DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"
HOME_ENV = "ONCEFLOW_KAFKA_HOME"
DEFAULT_CACHE = Path("~/.cache/onceflow")
MIN_JAVA = 17

MAIN_CLASS = "kafka.Kafka"
STORAGE_TOOL_CLASS = "kafka.tools.StorageTool"
# A small heap (the page cache holds the data, not the heap) and flags that start a JVM
# quickly: C1 only and the serial collector cut start-up by a second or more on two cores.
JVM_OPTIONS = (
    "-Xms64m",
    "-Xmx512m",
    "-XX:TieredStopAtLevel=1",
    "-XX:+UseSerialGC",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)
DEFAULT_HEAP = "512m"  # -Xmx of one broker; the nodes of a cluster take less each
CLUSTER_HEAP = "256m"
# The broker logs to standard output, which LocalKafka sends to its log file. The settings
# dumps (hundreds of lines, several per start) are left out: server.properties sits beside it.
LOG4J2_PROPERTIES = """\
status = warn
appender.out.type = Console
appender.out.name = OUT
appender.out.target = SYSTEM_OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = OUT
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.statechange.name = state.change.logger
logger.statechange.level = WARN
logger.config.name = org.apache.kafka.common.config.AbstractConfig
logger.config.level = WARN
"""

NODE_ID = 1
LOOPBACK = "127.0.0.1"
# Topics the broker creates for itself: one replica each on one node, and few partitions so
# that the first consumer group or transaction does not wait for 50 partitions to be created.
INTERNAL_TOPIC_PARTITIONS = 5
TEST_SETTINGS: Mapping[str, str] = {
    "num.partitions": "2",
    "default.replication.factor": "1",
    "min.insync.replicas": "1",
    "auto.create.topics.enable": "true",
    "delete.topic.enable": "true",
    "offsets.topic.replication.factor": "1",
    "offsets.topic.num.partitions": str(INTERNAL_TOPIC_PARTITIONS),
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "transaction.state.log.num.partitions": str(INTERNAL_TOPIC_PARTITIONS),
    "share.coordinator.state.topic.replication.factor": "1",
    "share.coordinator.state.topic.min.isr": "1",
    "group.initial.rebalance.delay.ms": "0",
    # Lets tests use short consumer session timeouts, so that a killed consumer's
    # partitions move quickly (Kafka's default minimum is 6 s).
    "group.min.session.timeout.ms": "1000",
    # No time-based retention unless a topic asks for it (retention.ms): retention judges a
    # record by its timestamp, and pipelines write event time (tests use fixed dates months
    # back), so Kafka's default of 7 days deletes their output within a retention check.
    "log.retention.ms": "-1",
    # Retention and delete_records take effect within a second, from the broker's start on.
    "log.retention.check.interval.ms": "1000",
    "log.initial.task.delay.ms": "0",
    "log.segment.delete.delay.ms": "1000",
    # The log cleaner looks for work twice a second, not every 15 s (compacted-topic tests).
    "log.cleaner.backoff.ms": "500",
    "file.delete.delay.ms": "1000",
    # After a kill -9 the restarted broker must wait for its previous registration to expire
    # before the controller takes it back: keep that wait short (Kafka's default is 9 s).
    "broker.session.timeout.ms": "3000",
    "broker.heartbeat.interval.ms": "500",
    # Two cores: fewer threads than Kafka's defaults.
    "num.network.threads": "2",
    "num.io.threads": "2",
    "background.threads": "2",
}

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0
KILL_TIMEOUT_S = 10.0
FORMAT_TIMEOUT_S = 120.0
DOWNLOAD_TIMEOUT_S = 900.0
PROBE_TIMEOUT_MS = 3000
POLL_INTERVAL_S = 0.1
PORT_ATTEMPTS = 5
LOG_TAIL_LINES = 25
MAVEN_ERROR_LINES = 3
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


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
    with _locked(home / ".fetch.lock"):
        if not _has_jars(libs):  # another process may have fetched it while we waited
            _download(mvn, version, libs)
    return home


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _pom(version: str) -> str:
    deps = [
        ("org.apache.kafka", f"kafka_{SCALA_VERSION}", version),
        ("org.apache.logging.log4j", "log4j-core", LOG4J_VERSION),
        ("org.apache.logging.log4j", "log4j-slf4j-impl", LOG4J_VERSION),
    ]
    body = "".join(
        f"<dependency><groupId>{g}</groupId><artifactId>{a}</artifactId>"
        f"<version>{v}</version></dependency>\n"
        for g, a, v in deps
    )
    return (
        '<project xmlns="http://maven.apache.org/POM/4.0.0">\n'
        "<modelVersion>4.0.0</modelVersion>\n"
        "<groupId>onceflow.local</groupId><artifactId>kafka-jars</artifactId>"
        "<version>1</version><packaging>pom</packaging>\n"
        f"<dependencies>\n{body}</dependencies>\n</project>\n"
    )


def _download(mvn: str, version: str, libs: Path) -> None:
    """Copy the runtime jars into a temporary sibling of ``libs``, then rename it into place."""
    print(
        f"onceflow: fetching Apache Kafka {version} jars from Maven Central into {libs} (once)",
        file=sys.stderr,
    )
    partial = libs.with_name(f".libs.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="onceflow-kafka-pom-") as work:
        Path(work, "pom.xml").write_text(_pom(version), encoding="utf-8")
        cmd = [
            mvn,
            "-B",
            "-q",
            "-Dstyle.color=never",
            "-U",  # retry artifacts that an earlier, failed attempt marked as missing
            f"{DEPENDENCY_PLUGIN}:copy-dependencies",
            "-DincludeScope=runtime",
            f"-DoutputDirectory={partial}",
        ]
        try:
            done = subprocess.run(
                cmd,
                cwd=work,
                capture_output=True,
                text=True,
                timeout=DOWNLOAD_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            done = None
    if done is None or done.returncode != 0 or not _has_jars(partial):
        shutil.rmtree(partial, ignore_errors=True)
        output = "" if done is None else (done.stdout + done.stderr)
        tail = "\n".join(_maven_errors(output))
        msg = (
            f"could not fetch Apache Kafka {version} from Maven Central with {' '.join(cmd)} "
            f"(expected its jars in {partial}); check that Maven reaches Central (a proxy or "
            f"mirror in ~/.m2/settings.xml), or set {HOME_ENV} to a folder whose libs/ holds "
            f"the Kafka jars. Maven said:\n{tail or 'nothing (timed out)'}"
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


def _maven_errors(output: str) -> list[str]:
    """Maven's first few error lines, without its boilerplate about -e and -X."""
    lines = _ANSI_ESCAPE.sub("", output).splitlines()
    errors = [
        line for line in lines if line.startswith("[ERROR]") and line[len("[ERROR]") :].strip()
    ]
    return (errors or lines)[:MAVEN_ERROR_LINES]


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


def new_cluster_id() -> str:
    """A random KRaft cluster id, as ``kafka-storage.sh random-uuid`` prints one."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode("ascii").rstrip("=")
        if not text.startswith("-"):  # Kafka never issues ids that look like an option
            return text


def broker_properties(
    port: int,
    controller_port: int,
    log_dir: str,
    node_id: int = NODE_ID,
    voters: str | None = None,
) -> dict[str, str]:
    """A KRaft broker+controller on loopback, with ``TEST_SETTINGS``.

    ``voters`` is the controller quorum (``id@host:port,...``); by default this node alone.
    """
    return {
        "process.roles": "broker,controller",
        "node.id": str(node_id),
        "controller.quorum.voters": voters or f"{node_id}@{LOOPBACK}:{controller_port}",
        "listeners": f"PLAINTEXT://{LOOPBACK}:{port},CONTROLLER://{LOOPBACK}:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://{LOOPBACK}:{port}",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "inter.broker.listener.name": "PLAINTEXT",
        "controller.listener.names": "CONTROLLER",
        "log.dirs": log_dir,
        **TEST_SETTINGS,
    }


def _other_port(taken: int) -> int:
    port = free_port()
    while port == taken:
        port = free_port()
    return port


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
        return [
            java_binary(),
            *JVM_OPTIONS,
            f"-Xmx{self.heap}",  # after JVM_OPTIONS' own: the last -Xmx counts
            f"-Dlog4j2.configurationFile={self._log4j_path()}",
            "-cp",
            str(home / "libs" / "*"),
            main,
            *args,
        ]

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
                if self._answers():
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

    def _answers(self) -> bool:
        with socket.create_connection((LOOPBACK, self.port), POLL_INTERVAL_S * 5):
            pass
        from kafka import KafkaAdminClient

        admin = KafkaAdminClient(
            bootstrap_servers=self.bootstrap,
            request_timeout_ms=PROBE_TIMEOUT_MS,
            connections_max_idle_ms=PROBE_TIMEOUT_MS * 10,
        )
        try:
            cluster = admin.describe_cluster()
        finally:
            admin.close()
        live = [b.get("broker_id") for b in cluster.get("brokers", []) if not b.get("is_fenced")]
        if cluster.get("cluster_id") != self.cluster_id:
            msg = (
                f"the broker on {self.bootstrap} belongs to cluster {cluster.get('cluster_id')}, "
                f"expected {self.cluster_id}: another process has the port"
            )
            raise ServiceError(msg)
        return self.node_id in live

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


# A cluster of three: what replication needs for a broker to go down without a write stopping
# (replication factor 3, min.insync.replicas 2, acks=all) and the internal topics alike.
CLUSTER_SETTINGS: Mapping[str, str] = {
    "default.replication.factor": "3",
    "min.insync.replicas": "2",
    "offsets.topic.replication.factor": "3",
    "transaction.state.log.replication.factor": "3",
    "transaction.state.log.min.isr": "2",
    "share.coordinator.state.topic.replication.factor": "3",
    "share.coordinator.state.topic.min.isr": "2",
    # A restarted broker becomes leader of its partitions again soon (a rolling restart
    # otherwise leaves every leader on the node restarted first).
    "leader.imbalance.check.interval.seconds": "5",
    # Followers catch up and rejoin the in-sync set without waiting for Kafka's defaults.
    "replica.lag.time.max.ms": "5000",
    "num.replica.fetchers": "1",
}
IN_SYNC_TIMEOUT_S = 120.0


class LocalKafkaCluster:
    """``brokers`` Apache Kafka nodes (KRaft) on loopback, each broker and controller at once.

    Every node votes in the controller quorum, so a cluster of three keeps a quorum and two
    in-sync replicas while any one node is down: topics get replication factor 3 and
    ``min.insync.replicas`` 2 (:data:`CLUSTER_SETTINGS`, with :data:`TEST_SETTINGS`).
    ``kill(i)``, ``stop(i)``, ``start_node(i)`` and ``restart(i)`` act on node ``i`` (0-based);
    :meth:`wait_in_sync` waits until every replica is back in sync (do it between the steps of
    a rolling restart, as an operator would). ``bootstrap`` names every node. Each JVM gets
    :data:`CLUSTER_HEAP` of heap (the page cache holds the data).

    Measured on two busy cores (shared with other tests): start (three formats, three JVMs at
    once) ~12-20 s; a node's restart after ``kill`` ~8-10 s, back in sync ~0.1-0.5 s later;
    ~280 MB resident per node.
    """

    def __init__(
        self,
        brokers: int = 3,
        directory: str | None = None,
        properties: Mapping[str, str] | None = None,
        version: str = KAFKA_VERSION,
    ) -> None:
        self._owns_directory = directory is None
        self.directory = directory or tempfile.mkdtemp(prefix="onceflow-kafka-cluster-")
        ports = _distinct_ports(2 * brokers)
        pairs = [(ports[2 * i], ports[2 * i + 1]) for i in range(brokers)]
        voters = ",".join(f"{i + 1}@{LOOPBACK}:{c}" for i, (_, c) in enumerate(pairs))
        settings = {**CLUSTER_SETTINGS, **(properties or {})}
        cluster_id = new_cluster_id()
        self.nodes = [
            LocalKafka(
                os.path.join(self.directory, f"node-{i + 1}"),
                port,
                controller,
                version,
                settings,
                node_id=i + 1,
                voters=voters,
                cluster_id=cluster_id,
                heap=CLUSTER_HEAP,
            )
            for i, (port, controller) in enumerate(pairs)
        ]

    @property
    def bootstrap(self) -> str:
        """Every node: ``127.0.0.1:P1,127.0.0.1:P2,...``."""
        return ",".join(node.bootstrap for node in self.nodes)

    def start(self) -> LocalKafkaCluster:
        """Launch every node at once (formats too: a JVM each), then wait until each answers."""
        for node in self.nodes:
            os.makedirs(node.directory, exist_ok=True)
        with ThreadPoolExecutor(len(self.nodes)) as pool:
            list(pool.map(LocalKafka.launch, self.nodes))
        for node in self.nodes:
            node.wait_ready()
        return self

    def kill(self, i: int) -> None:
        """SIGKILL node ``i``."""
        self.nodes[i].kill()

    def stop(self, i: int) -> None:
        """Shut node ``i`` down cleanly (its leaderships move first)."""
        self.nodes[i].stop()

    def start_node(self, i: int) -> None:
        """Start node ``i`` again on its directory and ports; wait until it answers."""
        self.nodes[i].start()

    def restart(self, i: int, kill: bool = True) -> None:
        """Kill (or stop) node ``i`` and start it again."""
        self.nodes[i].restart(kill=kill)

    def wait_in_sync(self, timeout_s: float = IN_SYNC_TIMEOUT_S) -> None:
        """Until every partition of every topic has all its replicas in sync."""
        from kafka import KafkaAdminClient

        deadline = time.monotonic() + timeout_s
        lagging: list[str] = ["(not asked yet)"]
        while time.monotonic() < deadline:
            try:
                admin = KafkaAdminClient(
                    bootstrap_servers=self.bootstrap, request_timeout_ms=PROBE_TIMEOUT_MS
                )
                try:
                    topics = admin.describe_topics()
                finally:
                    admin.close()
                lagging = [
                    f"{t['name']}:{p['partition_index']}"
                    for t in topics
                    for p in t["partitions"]
                    if p["error_code"] or len(p["isr_nodes"]) < len(p["replica_nodes"])
                ]
            except Exception as exc:  # noqa: BLE001 - a node still starting: ask again
                lagging = [f"{type(exc).__name__}: {exc}"]
            if not lagging:
                return
            time.sleep(POLL_INTERVAL_S * 5)
        msg = f"Kafka replicas not in sync within {timeout_s:.0f} s: {lagging[:5]}"
        raise ServiceError(msg)

    def close(self) -> None:
        """Stop every node, all at once (one by one, each waits for the others' shutdown)."""
        with ThreadPoolExecutor(len(self.nodes)) as pool:
            list(pool.map(LocalKafka.stop, self.nodes))

    def __enter__(self) -> LocalKafkaCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
        if self._owns_directory and exc_type is None:
            shutil.rmtree(self.directory, ignore_errors=True)


def _distinct_ports(n: int) -> list[int]:
    """``n`` different loopback ports that were free a moment ago."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports
