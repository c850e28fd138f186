"""A real Spark standalone cluster on loopback, for scale-out and node-loss tests.

``LocalSparkCluster`` runs a Spark standalone master and N workers (1 core, 1 GiB each by
default) from the installed PySpark, through ``pyspark/bin/spark-class``. A job submitted
with ``cluster.session_conf()`` runs its executors on those workers; ``kill_worker(i)`` is a
node loss (the worker JVM, its executor JVMs and their Python workers die together, by
SIGKILL) and ``restart_worker(i)`` brings the node back.

Every process runs in a session of its own and is tracked (:mod:`onceflow.testing.processes`):
``stop()``, or the end of the interpreter, kills each session whole, so no executor or Python
worker outlives its cluster.

>>> with LocalSparkCluster(workers=2) as spark_cluster:
...     builder = SparkSession.builder
...     for key, value in spark_cluster.session_conf().items():
...         builder = builder.config(key, value)
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onceflow.kernel.errors import ServiceError
from onceflow.testing.processes import (
    LOOPBACK,
    PORT_ATTEMPTS,
    executable,
    kill_tree,
    process_tree,
    running,
    start_in_session,
    tail,
    wait_for,
)
from onceflow.testing.services import free_port

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
    executable("java", "apt-get install -y openjdk-17-jre-headless, or set JAVA_HOME")


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

    def launch(self, args: list[str], cluster_directory: Path) -> None:
        """Start the JVM (``spark-class ARGS``) of this daemon of the cluster kept there."""
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "work").mkdir(exist_ok=True)
        script = str(spark_home() / "bin" / "spark-class")
        self.attempts += 1
        self.proc = start_in_session(
            [script, *args], self.log_path, daemon_env(cluster_directory, self)
        )

    def respawn_if_exited(self, start: Callable[[], None]) -> None:
        """A daemon that exited (its port was taken) is started again on fresh ports."""
        if self.proc is None or self.proc.poll() is None:
            return
        if self.attempts >= PORT_ATTEMPTS:
            msg = (
                f"Spark {self.name} exited with status {self.proc.returncode} "
                f"{self.attempts} times; the end of {self.log_path}:\n{tail(self.log_path)}"
            )
            raise ServiceError(msg)
        self.new_ports()
        start()


def daemon_env(cluster_directory: Path, daemon: _SparkDaemon) -> dict[str, str]:
    """The environment of a master or worker JVM of the cluster kept in ``cluster_directory``."""
    # No port probing (a taken port must fail, not silently move), quick dead-worker check.
    daemon_options = (
        f"{FAST_JVM_OPTIONS} -Dspark.port.maxRetries=0 -Dspark.worker.timeout={WORKER_TIMEOUT_S}"
    )
    return {
        **os.environ,
        "SPARK_HOME": str(spark_home()),
        "SPARK_CONF_DIR": str(cluster_directory / "conf"),  # empty: no stray spark-env.sh
        "SPARK_LOCAL_IP": LOOPBACK,
        "SPARK_DAEMON_MEMORY": SPARK_DAEMON_MEMORY,
        "SPARK_DAEMON_JAVA_OPTS": daemon_options,
        "SPARK_LAUNCHER_OPTS": f"{FAST_JVM_OPTIONS} {LAUNCHER_MEMORY_OPTIONS}",
        "SPARK_WORKER_DIR": str(daemon.directory / "work"),
        "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable),
    }


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
        return running(self._worker(index).proc)

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

    def _start_master(self) -> None:
        master = self._master
        master.attempts = 0

        def spawn() -> None:
            args = ["--host", LOOPBACK, "--port", str(master.port)]
            master.launch(
                [MASTER_CLASS, *args, "--webui-port", str(master.webui_port)], self.directory
            )

        def answers() -> bool | None:
            master.respawn_if_exited(spawn)
            state = self._master_state_or_none()
            return True if state is not None and state.get("status") == ALIVE else None

        spawn()
        wait_for(
            answers,
            SPARK_START_TIMEOUT_S,
            lambda: (
                f"the Spark master did not answer on {self.webui_url}/json/ within "
                f"{SPARK_START_TIMEOUT_S:.0f} s; the end of {master.log_path}:\n"
                f"{tail(master.log_path)}"
            ),
        )

    def _spawn_worker(self, worker: _SparkDaemon) -> None:
        args = ["--host", LOOPBACK, "--port", str(worker.port), "--webui-port"]
        args += [str(worker.webui_port), "--cores", str(self.cores)]
        args += ["--memory", f"{self.memory_mb}m", self.master_url]
        worker.launch([WORKER_CLASS, *args], self.directory)

    def _wait_workers_alive(self) -> None:
        """Until the master lists exactly our workers' ports as ALIVE."""

        def all_alive() -> bool | None:
            for worker in self._workers:
                worker.respawn_if_exited(functools.partial(self._spawn_worker, worker))
            state = self._master_state_or_none()
            if state is None:
                return None
            alive = {w["port"] for w in state["workers"] if w["state"] == ALIVE}
            return True if alive == {w.port for w in self._workers} else None

        def failure() -> str:
            logs = "\n".join(f"  {w.name}: {w.log_path}\n{tail(w.log_path)}" for w in self._workers)
            return (
                f"the Spark master at {self.master_url} did not list all {self.workers} workers "
                f"as ALIVE within {SPARK_START_TIMEOUT_S:.0f} s (see {self.webui_url}); "
                f"worker logs:\n{logs}"
            )

        wait_for(all_alive, SPARK_START_TIMEOUT_S, failure)
        for worker in self._workers:
            worker.attempts = 0

    def kill_worker(self, index: int) -> dict[int, str]:
        """Node loss: SIGKILL worker ``index`` with its executors and Python workers.

        Returns what was killed (pid -> command line) once none of it runs any more and the
        master no longer lists the worker as ALIVE.
        """
        worker = self._worker(index)
        if worker.proc is None or not running(worker.proc):
            msg = f"worker {index} is not running; restart_worker({index}) starts it again"
            raise ServiceError(msg)
        killed = kill_tree(worker.proc)

        def gone() -> bool | None:
            state = self._master_state_or_none()
            if state is None:
                return None
            alive = {w["port"] for w in state["workers"] if w["state"] == ALIVE}
            return True if worker.port not in alive else None

        wait_for(
            gone,
            WORKER_TIMEOUT_S * 2,
            lambda: f"the master still lists killed worker {index} (port {worker.port}) as ALIVE",
        )
        return killed

    def restart_worker(self, index: int) -> float:
        """Start worker ``index`` again (killing it first if it runs); seconds until ALIVE."""
        worker = self._worker(index)
        if worker.proc is not None and running(worker.proc):
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
                kill_tree(daemon.proc)

    def __enter__(self) -> LocalSparkCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
