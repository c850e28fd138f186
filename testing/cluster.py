"""Real multi-process clusters on loopback, for scale-out and node-loss tests.

``LocalSparkCluster`` runs a Spark standalone master and N workers (1 core, 1 GiB each by
default) from the installed PySpark, through ``pyspark/bin/spark-class``. A job submitted
with ``cluster.session_conf()`` runs its executors on those workers; ``kill_worker(i)`` is a
node loss (the worker JVM, its executor JVMs and their Python workers die together, by
SIGKILL) and ``restart_worker(i)`` brings the node back.

``LocalRedisCluster`` runs Debian's ``redis-server`` as a Redis Cluster of 3 masters and 3
replicas (AOF on, fsynced as exactly-once needs, see ``onceflow.testing.services``; a short
node timeout so that failover takes seconds). ``kill_master(i)`` is a crash of the master
serving the i-th slot range, ``wait_failover()`` measures the promotion of its replica,
``restart_node()`` brings the crashed node back as a replica.

Every process runs in a session of its own and is tracked: ``stop()``, or the end of the
interpreter, kills each session whole, so no executor or Python worker outlives its cluster.

>>> with LocalSparkCluster(workers=2) as spark_cluster, LocalRedisCluster() as redis_cluster:
...     builder = SparkSession.builder
...     for key, value in spark_cluster.session_conf().items():
...         builder = builder.config(key, value)
...     client = redis_cluster.client()
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from onceflow.kernel.errors import ServiceError
from onceflow.testing.services import free_port

if TYPE_CHECKING:
    import redis
    from redis.cluster import ClusterNode, RedisCluster

T = TypeVar("T")

LOOPBACK = "127.0.0.1"
POLL_INTERVAL_S = 0.1
KILL_TIMEOUT_S = 10.0
"""How long SIGKILLed processes get to disappear from the process table."""
PORT_ATTEMPTS = 5
"""A port picked by ``free_port`` can be taken before the server binds it: retry elsewhere."""
LOG_TAIL_LINES = 25

# --- Spark ------------------------------------------------------------------------------

FAST_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
"""C1 only and the serial collector. Measured here: a worker restart ~3-4.5 s with them,
~6.5-7 s without; master plus two workers ~8-12 s with them, ~12-19 s without."""
SPARK_DAEMON_MEMORY = "256m"
"""Heap of the master and worker daemons (they schedule; executors do the work)."""
LAUNCHER_MEMORY_OPTIONS = "-Xmx64m"
WORKER_CORES = 1
WORKER_MEMORY_MB = 1024
EXECUTOR_MEMORY_MB = 512
"""Executor heap suggested by ``session_conf``; capped at the worker's memory."""
WORKER_TIMEOUT_S = 15
"""Master side: a worker silent this long is dead. A killed worker's closed connection is
noticed at once; this only bounds the case where the connection does not close."""
SPARK_START_TIMEOUT_S = 180.0
"""Master plus two workers measured ~7-12 s on a loaded 2-core machine; generous for CI."""
HTTP_TIMEOUT_S = 2.0
MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
ALIVE = "ALIVE"

# --- Redis ------------------------------------------------------------------------------

REDIS_MASTERS = 3
REPLICAS_PER_MASTER = 1
CLUSTER_NODE_TIMEOUT_MS = 1000
"""A master unreachable this long is suspected; its replica takes over ~1-2 s later."""
HASH_SLOTS = 16384
REDIS_START_TIMEOUT_S = 15.0
CLUSTER_READY_TIMEOUT_S = 60.0
FAILOVER_TIMEOUT_S = 30.0
REDIS_SOCKET_TIMEOUT_S = 2.0
CLUSTER_CREATE_TIMEOUT_S = 60.0


# --- processes --------------------------------------------------------------------------

_RUNNING: set[subprocess.Popen[bytes]] = set()


@dataclass(frozen=True)
class _ProcessInfo:
    """One row of the process table."""

    ppid: int
    sid: int
    state: str


def _process_table() -> dict[int, _ProcessInfo]:
    """Every process, read from ``/proc/*/stat``: parent, session and state."""
    table: dict[int, _ProcessInfo] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text(encoding="utf-8")
        except OSError:
            continue
        # Fields after the parenthesised name: state, ppid, pgrp, session, ...
        fields = stat[stat.rfind(")") + 2 :].split()
        table[int(entry)] = _ProcessInfo(ppid=int(fields[1]), sid=int(fields[3]), state=fields[0])
    return table


def _command_line(pid: int) -> str:
    """The command line of ``pid``, or '' if it is gone."""
    try:
        raw = Path("/proc", str(pid), "cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()


def process_tree(root: int) -> dict[int, str]:
    """Live processes in ``root``'s session or descending from it: pid -> command line.

    A Spark worker started in a session of its own owns its executor JVMs and their Python
    workers both ways (same session, and descendants); either alone would miss a process
    that called ``setsid`` or was re-parented.
    """
    table = _process_table()
    members = {pid for pid, info in table.items() if info.sid == root}
    if root in table:
        members.add(root)
    grew = True
    while grew:
        children = {pid for pid, info in table.items() if info.ppid in members} - members
        members |= children
        grew = bool(children)
    return {pid: _command_line(pid) for pid in sorted(members) if table[pid].state != "Z"}


def _kill_tree(proc: subprocess.Popen[bytes]) -> dict[int, str]:
    """SIGKILL ``proc`` with its session and descendants, all at once; pid -> command line."""
    killed: dict[int, str] = {}
    deadline = time.monotonic() + KILL_TIMEOUT_S
    while True:
        alive = process_tree(proc.pid)
        if not alive:
            break
        if time.monotonic() > deadline:
            msg = (
                f"processes {sorted(alive)} of session {proc.pid} survived SIGKILL for "
                f"{KILL_TIMEOUT_S:.0f} s; look for them with 'ps -s {proc.pid}'"
            )
            raise ServiceError(msg)
        for pid, command in alive.items():
            killed.setdefault(pid, command)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(POLL_INTERVAL_S)
    proc.wait(KILL_TIMEOUT_S)
    _RUNNING.discard(proc)
    return killed


@atexit.register
def _kill_leftovers() -> None:
    for proc in list(_RUNNING):
        with contextlib.suppress(ServiceError, subprocess.TimeoutExpired):
            _kill_tree(proc)


def _spawn(
    cmd: list[str], log_path: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in a new session, output appended to ``log_path``, tracked for cleanup."""
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=log_path.parent,
            start_new_session=True,
        )
    _RUNNING.add(proc)
    return proc


def _running(proc: subprocess.Popen[bytes] | None) -> bool:
    return proc is not None and proc.poll() is None


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of a log, indented, for an error message."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "    (no log)"
    return "\n".join("    " + line for line in text.splitlines()[-lines:])


def _wait_for(check: Callable[[], T | None], timeout: float, failure: Callable[[], str]) -> T:
    """Poll ``check`` until it returns a value; ``failure()`` is the message on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise ServiceError(failure())
        time.sleep(POLL_INTERVAL_S)


def _executable(name: str, package_hint: str) -> str:
    path = shutil.which(name)
    if path is None:
        msg = f"{name} is not on PATH; install it ({package_hint}) and try again"
        raise ServiceError(msg)
    return path


# --- Spark ------------------------------------------------------------------------------


def spark_home() -> Path:
    """The installed ``pyspark`` folder, which is a complete SPARK_HOME (jars, bin)."""
    spec = importlib.util.find_spec("pyspark")
    if spec is None or not spec.submodule_search_locations:
        msg = "pyspark is not installed in this interpreter; pip install 'pyspark[sql]>=4.2'"
        raise ServiceError(msg)
    home = Path(next(iter(spec.submodule_search_locations)))
    script = home / "bin" / "spark-class"
    if not script.exists():
        msg = f"the pyspark installation at {home} has no bin/spark-class; reinstall pyspark"
        raise ServiceError(msg)
    if not os.access(script, os.X_OK):
        script.chmod(0o755)
    return home


def _java_available() -> None:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and Path(java_home, "bin", "java").exists():
        return
    _executable("java", "apt-get install -y openjdk-17-jre-headless, or set JAVA_HOME")


@dataclass
class _SparkDaemon:
    """A master or worker JVM: its ports, its folder (log, work dir) and its process."""

    name: str
    directory: Path
    port: int
    webui_port: int
    proc: subprocess.Popen[bytes] | None = None
    attempts: int = 0

    @property
    def log_path(self) -> Path:
        return self.directory / f"{self.name}.log"

    def new_ports(self) -> None:
        self.port, self.webui_port = free_port(), free_port()


class LocalSparkCluster:
    """A Spark standalone master and ``workers`` workers on loopback, each JVM in its own session.

    Ports are picked free and Spark's own port probing is off (``spark.port.maxRetries=0``),
    so a daemon either binds the port asked or exits, and is then retried on fresh ports.
    Logs stay in ``directory``: ``master.log``, ``worker-I/worker-I.log`` and each executor's
    ``worker-I/work/APP/EXECUTOR/stderr``.
    """

    def __init__(
        self,
        workers: int = 2,
        *,
        cores: int = WORKER_CORES,
        memory_mb: int = WORKER_MEMORY_MB,
        directory: str | None = None,
    ) -> None:
        if workers < 1:
            msg = f"a Spark cluster needs at least one worker, got workers={workers}"
            raise ValueError(msg)
        self.directory = Path(directory or tempfile.mkdtemp(prefix="onceflow-spark-cluster-"))
        self.cores = cores
        self.memory_mb = memory_mb
        self._master = _SparkDaemon("master", self.directory, free_port(), free_port())
        self._workers = [
            _SparkDaemon(f"worker-{i}", self.directory / f"worker-{i}", free_port(), free_port())
            for i in range(workers)
        ]
        self.start_seconds: float | None = None
        """Wall time of the last ``start()``: master up and every worker registered."""

    # -- addresses and settings --

    @property
    def workers(self) -> int:
        """Number of workers."""
        return len(self._workers)

    @property
    def master_url(self) -> str:
        """``spark://127.0.0.1:PORT``, for ``SparkSession.builder.master(...)``."""
        return f"spark://{LOOPBACK}:{self._master.port}"

    @property
    def webui_url(self) -> str:
        """The master's web UI; its JSON status is at ``/json/``."""
        return f"http://{LOOPBACK}:{self._master.webui_port}"

    def session_conf(self) -> dict[str, str]:
        """Settings for a driver on this cluster: one executor per worker, small fast JVMs.

        The first job waits until every worker's executor registered, so work spreads over
        all of them. The driver also needs ``SPARK_LOCAL_IP=127.0.0.1`` and ``PYSPARK_PYTHON``
        in its environment before its JVM starts.
        """
        return {
            "spark.master": self.master_url,
            "spark.cores.max": str(self.workers * self.cores),
            "spark.executor.cores": str(self.cores),
            "spark.executor.memory": f"{min(EXECUTOR_MEMORY_MB, self.memory_mb)}m",
            "spark.scheduler.minRegisteredResourcesRatio": "1.0",
            "spark.scheduler.maxRegisteredResourcesWaitingTime": f"{SPARK_START_TIMEOUT_S:.0f}s",
            "spark.driver.host": LOOPBACK,
            "spark.driver.bindAddress": LOOPBACK,
            "spark.driver.extraJavaOptions": FAST_JVM_OPTIONS,
            "spark.executor.extraJavaOptions": FAST_JVM_OPTIONS,
            "spark.pyspark.python": sys.executable,
            "spark.ui.enabled": "false",
        }

    def _env(self, daemon: _SparkDaemon) -> dict[str, str]:
        # No port probing (a taken port must fail, not silently move), quick dead-worker check.
        daemon_options = (
            f"{FAST_JVM_OPTIONS} -Dspark.port.maxRetries=0 "
            f"-Dspark.worker.timeout={WORKER_TIMEOUT_S}"
        )
        return {
            **os.environ,
            "SPARK_HOME": str(spark_home()),
            "SPARK_CONF_DIR": str(self.directory / "conf"),  # empty: no stray spark-env.sh
            "SPARK_LOCAL_IP": LOOPBACK,
            "SPARK_DAEMON_MEMORY": SPARK_DAEMON_MEMORY,
            "SPARK_DAEMON_JAVA_OPTS": daemon_options,
            "SPARK_LAUNCHER_OPTS": f"{FAST_JVM_OPTIONS} {LAUNCHER_MEMORY_OPTIONS}",
            "SPARK_WORKER_DIR": str(daemon.directory / "work"),
            "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable),
        }

    # -- status --

    def master_state(self) -> dict[str, Any]:
        """The master's JSON status: ``workers`` (id, port, state, cores...), ``activeapps``."""
        url = f"{self.webui_url}/json/"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(url, timeout=HTTP_TIMEOUT_S) as response:
            state: dict[str, Any] = json.load(response)
        return state

    def _master_state_or_none(self) -> dict[str, Any] | None:
        try:
            return self.master_state()
        except (OSError, ValueError):  # not listening yet, or a half-written answer
            return None

    def alive_workers(self) -> list[dict[str, Any]]:
        """The master's entries for workers in state ALIVE (dead ones stay listed as DEAD)."""
        state = self.master_state()
        return [w for w in state["workers"] if w["state"] == ALIVE]

    def worker_pid(self, index: int) -> int:
        """PID of worker ``index``'s JVM, which is also the session id of its executors."""
        proc = self._worker(index).proc
        if proc is None:
            msg = f"worker {index} was never started; call start() first"
            raise ServiceError(msg)
        return proc.pid

    def worker_alive(self, index: int) -> bool:
        """Whether worker ``index``'s JVM is running."""
        return _running(self._worker(index).proc)

    def worker_processes(self, index: int) -> dict[int, str]:
        """Worker ``index``'s JVM, executor JVMs and Python workers: pid -> command line."""
        return process_tree(self.worker_pid(index))

    def _worker(self, index: int) -> _SparkDaemon:
        if not 0 <= index < len(self._workers):
            msg = f"no worker {index}: this cluster has workers 0..{len(self._workers) - 1}"
            raise IndexError(msg)
        return self._workers[index]

    # -- lifecycle --

    def start(self) -> LocalSparkCluster:
        """Start the master, then every worker; return once all are registered and ALIVE."""
        _java_available()
        (self.directory / "conf").mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        try:
            self._start_master()
            for worker in self._workers:
                self._spawn_worker(worker)
            self._wait_workers_alive()
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - started
        return self

    def _launch(self, daemon: _SparkDaemon, args: list[str]) -> None:
        daemon.directory.mkdir(parents=True, exist_ok=True)
        (daemon.directory / "work").mkdir(exist_ok=True)
        script = str(spark_home() / "bin" / "spark-class")
        daemon.attempts += 1
        daemon.proc = _spawn([script, *args], daemon.log_path, self._env(daemon))

    def _respawn_if_exited(self, daemon: _SparkDaemon, spawn: Callable[[], None]) -> None:
        """A daemon that exited (its port was taken) is started again on fresh ports."""
        if daemon.proc is None or daemon.proc.poll() is None:
            return
        if daemon.attempts >= PORT_ATTEMPTS:
            msg = (
                f"Spark {daemon.name} exited with status {daemon.proc.returncode} "
                f"{daemon.attempts} times; the end of {daemon.log_path}:\n{_tail(daemon.log_path)}"
            )
            raise ServiceError(msg)
        daemon.new_ports()
        spawn()

    def _start_master(self) -> None:
        master = self._master
        master.attempts = 0

        def spawn() -> None:
            args = ["--host", LOOPBACK, "--port", str(master.port)]
            self._launch(master, [MASTER_CLASS, *args, "--webui-port", str(master.webui_port)])

        def answers() -> bool | None:
            self._respawn_if_exited(master, spawn)
            state = self._master_state_or_none()
            return True if state is not None and state.get("status") == ALIVE else None

        spawn()
        _wait_for(
            answers,
            SPARK_START_TIMEOUT_S,
            lambda: (
                f"the Spark master did not answer on {self.webui_url}/json/ within "
                f"{SPARK_START_TIMEOUT_S:.0f} s; the end of {master.log_path}:\n"
                f"{_tail(master.log_path)}"
            ),
        )

    def _spawn_worker(self, worker: _SparkDaemon) -> None:
        args = ["--host", LOOPBACK, "--port", str(worker.port), "--webui-port"]
        args += [str(worker.webui_port), "--cores", str(self.cores)]
        args += ["--memory", f"{self.memory_mb}m", self.master_url]
        self._launch(worker, [WORKER_CLASS, *args])

    def _wait_workers_alive(self) -> None:
        """Until the master lists exactly our workers' ports as ALIVE."""

        def all_alive() -> bool | None:
            for worker in self._workers:
                self._respawn_if_exited(worker, functools.partial(self._spawn_worker, worker))
            state = self._master_state_or_none()
            if state is None:
                return None
            alive = {w["port"] for w in state["workers"] if w["state"] == ALIVE}
            return True if alive == {w.port for w in self._workers} else None

        def failure() -> str:
            logs = "\n".join(
                f"  {w.name}: {w.log_path}\n{_tail(w.log_path)}" for w in self._workers
            )
            return (
                f"the Spark master at {self.master_url} did not list all {self.workers} workers "
                f"as ALIVE within {SPARK_START_TIMEOUT_S:.0f} s (see {self.webui_url}); "
                f"worker logs:\n{logs}"
            )

        _wait_for(all_alive, SPARK_START_TIMEOUT_S, failure)
        for worker in self._workers:
            worker.attempts = 0

    def kill_worker(self, index: int) -> dict[int, str]:
        """Node loss: SIGKILL worker ``index`` with its executors and Python workers.

        Returns what was killed (pid -> command line) once none of it runs any more and the
        master no longer lists the worker as ALIVE.
        """
        worker = self._worker(index)
        if worker.proc is None or not _running(worker.proc):
            msg = f"worker {index} is not running; restart_worker({index}) starts it again"
            raise ServiceError(msg)
        killed = _kill_tree(worker.proc)

        def gone() -> bool | None:
            state = self._master_state_or_none()
            if state is None:
                return None
            alive = {w["port"] for w in state["workers"] if w["state"] == ALIVE}
            return True if worker.port not in alive else None

        _wait_for(
            gone,
            WORKER_TIMEOUT_S * 2,
            lambda: f"the master still lists killed worker {index} (port {worker.port}) as ALIVE",
        )
        return killed

    def restart_worker(self, index: int) -> float:
        """Start worker ``index`` again (killing it first if it runs); seconds until ALIVE."""
        worker = self._worker(index)
        if worker.proc is not None and _running(worker.proc):
            self.kill_worker(index)
        started = time.monotonic()
        worker.attempts = 0
        self._spawn_worker(worker)
        self._wait_workers_alive()
        return time.monotonic() - started

    def stop(self) -> None:
        """Kill every worker (with its executors) and the master; nothing is left running."""
        for daemon in [*self._workers, self._master]:
            if daemon.proc is not None:
                _kill_tree(daemon.proc)

    def __enter__(self) -> LocalSparkCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- Redis ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RedisNode:
    """One node as ``CLUSTER NODES`` describes it."""

    node_id: str
    port: int
    role: str
    """``"master"`` or ``"replica"``."""
    master_id: str | None
    """For a replica, the node id of its master."""
    slots: tuple[tuple[int, int], ...]
    """Inclusive slot ranges served (masters only)."""
    failed: bool
    """Flagged ``fail`` (agreed by a majority) or ``fail?`` (suspected by the observer)."""
    connected: bool

    def serves(self, slot: int) -> bool:
        """Whether ``slot`` falls in one of this node's ranges."""
        return any(first <= slot <= last for first, last in self.slots)

    @classmethod
    def parse(cls, line: str) -> RedisNode:
        """One line of ``CLUSTER NODES``: id addr flags master ping pong epoch link slots."""
        fields = line.split()
        address, flags = fields[1], set(fields[2].split(","))
        slots: list[tuple[int, int]] = []
        for item in fields[8:]:
            if item.startswith("["):  # a slot being migrated or imported
                continue
            first, _, last = item.partition("-")
            slots.append((int(first), int(last or first)))
        return cls(
            node_id=fields[0],
            port=int(address.split("@")[0].rsplit(":", 1)[1]),
            role="master" if "master" in flags else "replica",
            master_id=None if fields[3] == "-" else fields[3],
            slots=tuple(slots),
            failed=bool(flags & {"fail", "fail?"}),
            connected=fields[7] == "connected",
        )


@dataclass(frozen=True)
class NodeStats:
    """What one node holds: for reporting how keys spread over the cluster."""

    port: int
    role: str
    keys: int
    used_memory: int
    """Bytes, from ``INFO memory``."""


@dataclass(frozen=True)
class Failover:
    """A master's crash and its replica's promotion, as ``wait_failover`` observed them."""

    killed_port: int
    promoted_port: int
    seconds: float
    """From the SIGKILL until every live node agreed on the new master and said ``ok``."""


@dataclass
class _RedisProcess:
    port: int
    bus_port: int
    directory: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.directory / "redis.log"


class LocalRedisCluster:
    """A Redis Cluster of ``masters`` masters, each with ``replicas`` replicas, on loopback.

    Each node has its own folder under ``directory`` (AOF, ``nodes.conf``, ``redis.log``)
    and an explicit cluster bus port: the default bus port (port + 10000) overflows for a
    free port above 55535.
    """

    def __init__(
        self,
        masters: int = REDIS_MASTERS,
        replicas: int = REPLICAS_PER_MASTER,
        *,
        node_timeout_ms: int = CLUSTER_NODE_TIMEOUT_MS,
        directory: str | None = None,
    ) -> None:
        if masters < 3:
            msg = f"Redis Cluster needs at least 3 masters to vote, got masters={masters}"
            raise ValueError(msg)
        self.directory = Path(directory or tempfile.mkdtemp(prefix="onceflow-redis-cluster-"))
        self.master_count = masters
        self.replicas_per_master = replicas
        self.node_timeout_ms = node_timeout_ms
        count = masters * (1 + replicas)
        self._nodes = [
            _RedisProcess(free_port(), free_port(), self.directory / f"node-{i}")
            for i in range(count)
        ]
        self._clients: dict[int, redis.Redis[str]] = {}
        self._last_kill: tuple[RedisNode, float] | None = None
        self.create_seconds: float | None = None
        """Wall time of the last ``start()``: processes up, cluster created, all nodes ok."""

    # -- addresses --

    @property
    def ports(self) -> list[int]:
        """Every node's client port, running or not."""
        return [node.port for node in self._nodes]

    def running_ports(self) -> list[int]:
        """Client ports of the nodes whose process runs."""
        return [node.port for node in self._nodes if _running(node.proc)]

    def killed_ports(self) -> list[int]:
        """Client ports of started nodes whose process is not running."""
        return [n.port for n in self._nodes if n.proc is not None and not _running(n.proc)]

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT`` of a running node, for ``RedisCluster.from_url``."""
        running = self.running_ports()
        if not running:
            msg = "no node of this Redis Cluster is running; call start() or restart_node()"
            raise ServiceError(msg)
        return f"redis://{LOOPBACK}:{running[0]}"

    @property
    def startup_nodes(self) -> list[ClusterNode]:
        """Every running node, for ``RedisCluster(startup_nodes=...)``."""
        from redis.cluster import ClusterNode

        return [ClusterNode(LOOPBACK, port) for port in self.running_ports()]

    def client(self, **kwargs: Any) -> RedisCluster[Any]:
        """A redis-py cluster client on the running nodes (``kwargs`` go to ``RedisCluster``)."""
        from redis.cluster import RedisCluster

        return RedisCluster(startup_nodes=self.startup_nodes, **kwargs)

    def node_client(self, port: int) -> redis.Redis[str]:
        """A plain client of one node (strings decoded), for node-level commands."""
        import redis

        if port not in self._clients:
            self._clients[port] = redis.Redis(
                host=LOOPBACK,
                port=port,
                decode_responses=True,
                socket_timeout=REDIS_SOCKET_TIMEOUT_S,
                socket_connect_timeout=REDIS_SOCKET_TIMEOUT_S,
            )
        return self._clients[port]

    # -- topology --

    def nodes(self, port: int | None = None) -> list[RedisNode]:
        """The cluster as node ``port`` (default: the first running node) sees it."""
        observer = port if port is not None else self._observer()
        text = str(self.node_client(observer).execute_command("CLUSTER", "NODES"))
        return [RedisNode.parse(line) for line in text.splitlines() if line.strip()]

    def masters(self) -> list[RedisNode]:
        """Masters serving slots and not failed, in slot order: ``masters()[0]`` has slot 0."""
        serving = [n for n in self.nodes() if n.role == "master" and n.slots and not n.failed]
        return sorted(serving, key=lambda n: n.slots[0][0])

    def replicas(self) -> list[RedisNode]:
        """Replicas not failed, by port."""
        return sorted(
            (n for n in self.nodes() if n.role == "replica" and not n.failed),
            key=lambda n: n.port,
        )

    def slot_owner(self, slot: int) -> RedisNode:
        """The live master serving ``slot``."""
        if not 0 <= slot < HASH_SLOTS:
            msg = f"slot {slot} is out of range: Redis Cluster slots are 0..{HASH_SLOTS - 1}"
            raise ValueError(msg)
        for node in self.masters():
            if node.serves(slot):
                return node
        msg = f"no live master serves slot {slot}; wait_failover() if a master was killed"
        raise ServiceError(msg)

    def node_stats(self) -> list[NodeStats]:
        """Keys (DBSIZE) and used memory of every running node, by port."""
        stats = []
        for port in self.running_ports():
            client = self.node_client(port)
            role = client.info("replication")["role"]
            stats.append(
                NodeStats(
                    port=port,
                    role="master" if role == "master" else "replica",
                    keys=int(client.dbsize()),
                    used_memory=int(client.info("memory")["used_memory"]),
                )
            )
        return stats

    def _observer(self) -> int:
        running = self.running_ports()
        if not running:
            msg = "no node of this Redis Cluster is running; call start() or restart_node()"
            raise ServiceError(msg)
        return running[0]

    # -- lifecycle --

    def start(self) -> LocalRedisCluster:
        """Start every node, create the cluster, return once every node says ``ok``."""
        server = _executable("redis-server", "apt-get install -y redis-server")
        started = time.monotonic()
        try:
            for node in self._nodes:
                self._start_node(node, server)
            self._create()
            self._wait_settled()
        except BaseException:
            self.stop()
            raise
        self.create_seconds = time.monotonic() - started
        return self

    def _command(self, node: _RedisProcess, server: str) -> list[str]:
        args = {
            "port": node.port,
            "cluster-port": node.bus_port,
            "bind": LOOPBACK,
            "dir": node.directory,
            "cluster-enabled": "yes",
            "cluster-config-file": "nodes.conf",
            "cluster-node-timeout": self.node_timeout_ms,
            # Always let a replica take over, however long it was cut off (tests crash on purpose).
            "cluster-replica-validity-factor": 0,
            # A replica's full sync starts at once instead of waiting 5 s for more replicas.
            "repl-diskless-sync-delay": 0,
            "appendonly": "yes",
            "appendfsync": "always",
            "save": "",
            "protected-mode": "no",
            "daemonize": "no",
            "loglevel": "notice",
        }
        return [server, *(item for k, v in args.items() for item in (f"--{k}", str(v)))]

    def _start_node(self, node: _RedisProcess, server: str, fresh_ports: bool = True) -> None:
        """Start one node and wait until it answers; a taken port means fresh ports (if allowed)."""
        node.directory.mkdir(parents=True, exist_ok=True)
        for _attempt in range(PORT_ATTEMPTS):
            node.proc = _spawn(self._command(node, server), node.log_path)
            if self._answers(node):
                return
            if node.proc.poll() is None or not fresh_ports:
                break
            node.port, node.bus_port = free_port(), free_port()
        msg = (
            f"redis-server did not answer on port {node.port} within "
            f"{REDIS_START_TIMEOUT_S:.0f} s; "
            f"the end of {node.log_path}:\n{_tail(node.log_path)}"
        )
        raise ServiceError(msg)

    def _answers(self, node: _RedisProcess) -> bool:
        import redis

        client = self.node_client(node.port)
        deadline = time.monotonic() + REDIS_START_TIMEOUT_S
        while time.monotonic() < deadline and _running(node.proc):
            with contextlib.suppress(
                redis.exceptions.ConnectionError, redis.exceptions.BusyLoadingError
            ):
                if client.ping():
                    return True
            time.sleep(POLL_INTERVAL_S / 2)
        return False

    def _create(self) -> None:
        cli = _executable("redis-cli", "apt-get install -y redis-tools")
        addresses = [f"{LOOPBACK}:{node.port}" for node in self._nodes]
        cmd = [cli, "--cluster", "create", *addresses]
        cmd += ["--cluster-replicas", str(self.replicas_per_master), "--cluster-yes"]
        result = subprocess.run(
            cmd, capture_output=True, text=True, timeout=CLUSTER_CREATE_TIMEOUT_S, check=False
        )
        if result.returncode != 0:
            msg = (
                f"'redis-cli --cluster create' exited with status {result.returncode}; "
                f"expected it to join {len(addresses)} empty nodes. Its output:\n"
                f"{result.stdout[-3000:]}{result.stderr[-2000:]}"
            )
            raise ServiceError(msg)

    def cluster_info(self, port: int) -> dict[str, str]:
        """``CLUSTER INFO`` of node ``port`` as a dict (``cluster_state``, ...)."""
        info = str(self.node_client(port).execute_command("CLUSTER", "INFO"))
        return dict(line.split(":", 1) for line in info.splitlines() if ":" in line)

    def _state_ok(self, port: int) -> bool:
        return self.cluster_info(port).get("cluster_state") == "ok"

    def _settled_view(self, port: int) -> bool:
        """Node ``port`` sees every master with its replicas, nobody failed, and is ok."""
        view = self.nodes(port)
        if any(n.failed or not n.connected for n in view):
            return False
        masters = [n for n in view if n.role == "master" and n.slots]
        replicas = [n for n in view if n.role == "replica"]
        return (
            len(masters) == self.master_count
            and all(
                sum(r.master_id == m.node_id for r in replicas) == self.replicas_per_master
                for m in masters
            )
            and self._state_ok(port)
            and int(self.cluster_info(port)["cluster_known_nodes"]) == len(self._nodes)
        )

    def _replica_linked(self, port: int) -> bool:
        info = self.node_client(port).info("replication")
        return info["role"] == "master" or info.get("master_link_status") == "up"

    def _wait_settled(self) -> None:
        """Until every node runs, agrees on the full topology and every replica is in sync."""
        import redis

        def settled() -> bool | None:
            if self.killed_ports():
                msg = f"nodes {self.killed_ports()} are not running; restart_node() them first"
                raise ServiceError(msg)
            ports = self.running_ports()
            try:
                ok = all(self._settled_view(p) and self._replica_linked(p) for p in ports)
            except redis.exceptions.RedisError:
                return None
            return True if ok else None

        _wait_for(
            settled,
            CLUSTER_READY_TIMEOUT_S,
            lambda: (
                f"the Redis Cluster on ports {self.ports} did not settle (cluster_state:ok, "
                f"{self.master_count} masters with {self.replicas_per_master} linked replica(s) "
                f"each) within {CLUSTER_READY_TIMEOUT_S:.0f} s; node logs are in {self.directory}"
            ),
        )

    def _process(self, port: int) -> _RedisProcess:
        for node in self._nodes:
            if node.port == port:
                return node
        msg = f"no node of this cluster listens on port {port}; its ports are {self.ports}"
        raise ServiceError(msg)

    def kill_master(self, index: int) -> RedisNode:
        """SIGKILL the master serving the ``index``-th slot range (0 holds slot 0)."""
        masters = self.masters()
        if not 0 <= index < len(masters):
            msg = f"no master {index}: {len(masters)} live masters serve slots now"
            raise IndexError(msg)
        victim = masters[index]
        process = self._process(victim.port)
        if process.proc is not None:
            _kill_tree(process.proc)
        self._last_kill = (victim, time.monotonic())
        return victim

    def cut_off_replicas(self, index: int) -> list[int]:
        """Freeze the replicas of the ``index``-th master and drop their links to it.

        What that master writes from now on reaches none of them (a replica that lags, as
        asynchronous replication allows): a failover then promotes a replica without those
        writes. :meth:`resume_nodes` lets the frozen processes run again. Returns their ports.
        """
        master = self.masters()[index]
        ports = [r.port for r in self.replicas() if r.master_id == master.node_id]
        for port in ports:
            proc = self._process(port).proc
            if proc is not None:
                os.kill(proc.pid, signal.SIGSTOP)
        self.node_client(master.port).execute_command("CLIENT", "KILL", "TYPE", "replica")
        return ports

    def resume_nodes(self, ports: list[int]) -> None:
        """Let nodes frozen by :meth:`cut_off_replicas` run again."""
        for port in ports:
            proc = self._process(port).proc
            if proc is not None and _running(proc):
                os.kill(proc.pid, signal.SIGCONT)

    def wait_failover(self, timeout: float = FAILOVER_TIMEOUT_S) -> Failover:
        """Until a replica took over the killed master's slots and every live node is ok."""
        import redis

        if self._last_kill is None:
            msg = "wait_failover() follows kill_master(); no master was killed"
            raise ServiceError(msg)
        victim, killed_at = self._last_kill
        slot = victim.slots[0][0]

        def promoted() -> int | None:
            owners = set()
            try:
                for port in self.running_ports():
                    view = self.nodes(port)
                    owner = [n for n in view if n.role == "master" and n.serves(slot)]
                    if len(owner) != 1 or owner[0].failed or not self._state_ok(port):
                        return None
                    owners.add(owner[0].port)
            except redis.exceptions.RedisError:
                return None
            if len(owners) == 1 and victim.port not in owners:
                return owners.pop()
            return None

        new_port = _wait_for(
            promoted,
            timeout,
            lambda: (
                f"no replica took over slot {slot} from killed master port {victim.port} within "
                f"{timeout:.0f} s (cluster-node-timeout {self.node_timeout_ms} ms); node logs are "
                f"in {self.directory}"
            ),
        )
        return Failover(victim.port, new_port, time.monotonic() - killed_at)

    def restart_node(self, port: int | None = None) -> float:
        """Start a killed node again (default: the last killed master) on its port and folder.

        It reads its AOF and ``nodes.conf``, learns that its slots moved to a newer master and
        rejoins as that master's replica. Returns the seconds until the cluster settled.
        """
        if port is None:
            if self._last_kill is None:
                msg = "restart_node() needs a port: no node was killed through kill_master()"
                raise ServiceError(msg)
            port = self._last_kill[0].port
        node = self._process(port)
        if _running(node.proc):
            msg = f"node {port} is running; kill it before restarting it"
            raise ServiceError(msg)
        started = time.monotonic()
        self._start_node(
            node, _executable("redis-server", "apt-get install -y redis-server"), False
        )
        self._wait_settled()
        return time.monotonic() - started

    def stop(self) -> None:
        """SIGKILL every node; their folders (AOF, ``nodes.conf``, ``redis.log``) stay."""
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        for node in self._nodes:
            if node.proc is not None:
                _kill_tree(node.proc)

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
