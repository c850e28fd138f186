"""A benchmark leaves no process behind (``bench/teardown.py``): its Redis, its Kafka broker and
the process trees of the systems it measures are gone once it exits, however it exits.

Each test runs a small benchmark in a child process: ``exactly_once.services`` (the Redis and
Kafka of ``bench/peers.py``, ``bench/exactly_once.py`` and most others) around a measured
system started with ``own_session`` (a process that starts a grandchild, as a Spark driver
starts its JVM). The test stops it one way, then looks for every process it had started.
Only SIGTERM starts the Kafka broker (~5 s); the other ways are given a bootstrap address, so
only Redis starts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
READY_TIMEOUT_S = 60.0
EXIT_TIMEOUT_S = 30.0

BENCHMARK = """
import os, sys, time

from exactly_once import services
from teardown import own_session

SYSTEM = "import subprocess, time; subprocess.Popen(['sleep', '600']); time.sleep(600)"


def session(pid):
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[3])


with services(False), own_session([sys.executable, "-c", SYSTEM]) as system:
    while len([p for p in os.listdir("/proc") if p.isdigit() and session(p) == system.pid]) < 2:
        time.sleep(0.05)  # the system and its grandchild are up
    print("READY", flush=True)
    if sys.argv[1] == "raise":
        sys.stdin.readline()  # once the test has seen what runs
        raise RuntimeError("a benchmark failing mid-run")
    time.sleep(600)
"""


def _stat(pid: int) -> list[str] | None:
    """The fields after the command's name in ``/proc/<pid>/stat`` (None: gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def _started_by(root: int) -> dict[int, str]:
    """Living descendants of ``root`` and members of their sessions: pid -> command line."""
    table = {int(p): _stat(int(p)) for p in os.listdir("/proc") if p.isdigit()}
    rows = {pid: fields for pid, fields in table.items() if fields is not None}
    tree, grown = {root}, {root}
    while grown:
        children = {pid for pid, f in rows.items() if int(f[1]) in grown}
        sessions = {pid for pid, f in rows.items() if int(f[3]) in children}
        grown = (children | sessions) - tree
        tree |= grown
    tree.discard(root)
    return {pid: _cmdline(pid) for pid in sorted(tree) if _alive(pid)}


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return ""


def _run(tmp_path: Path, how: str, env: dict[str, str]) -> tuple[dict[int, str], list[int], str]:
    """Start the benchmark, stop it ``how``; what it had started, what of it is left, its log."""
    script = tmp_path / "benchmark.py"
    script.write_text(BENCHMARK)
    env = {**env, "PYTHONPATH": os.pathsep.join([str(BENCH), env.get("PYTHONPATH", "")])}
    log = tmp_path / "benchmark.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(script), how],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # a signal to this test's group must not reach it
            preexec_fn=_default_signals,  # noqa: PLW1509 - signal dispositions only
        )
    started: dict[int, str] = {}
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while "READY" not in log.read_text() and proc.poll() is None:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        started = _started_by(proc.pid)
        if how == "raise":
            proc.communicate(b"go\n", EXIT_TIMEOUT_S)
        else:
            proc.send_signal(getattr(signal, how))
        proc.wait(EXIT_TIMEOUT_S)
        return started, [pid for pid in started if _alive(pid)], log.read_text()
    finally:
        proc.kill()
        proc.wait()
        for pid, command in started.items():  # what this test started and left, nothing else
            if _alive(pid) and _cmdline(pid) == command:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _default_signals() -> None:
    """The child's SIGINT and SIGHUP as a terminal's would be, whatever started the suite.

    A suite started in the background (``cmd &`` in a script: SIGINT ignored) or under
    ``nohup`` (SIGHUP ignored) passes the ignoring on through exec, and Python keeps an
    ignored SIGINT ignored: the benchmark would rightly go on running, as its user asked.
    """
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def _environment(kafka: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "KAFKA_BOOTSTRAP_SERVERS")}
    if not kafka:
        env["KAFKA_BOOTSTRAP_SERVERS"] = "127.0.0.1:9"  # services() starts no broker
    return env


def test_sigterm_stops_redis_kafka_and_the_measured_system(tmp_path):
    started, left, output = _run(tmp_path, "SIGTERM", _environment(kafka=True))
    kinds = " ".join(started.values())
    assert "redis-server" in kinds, started
    assert "kafka.Kafka" in kinds, started
    assert "sleep 600" in kinds, started
    assert not left, f"left running: {[started[pid] for pid in left]}\n{output}"


@pytest.mark.parametrize("how", ["SIGINT", "SIGHUP", "raise"])
def test_every_other_way_out_stops_them_too(tmp_path, how):
    started, left, output = _run(tmp_path, how, _environment(kafka=False))
    kinds = " ".join(started.values())
    assert "redis-server" in kinds, started
    assert "sleep 600" in kinds, started
    assert not left, f"left running: {[started[pid] for pid in left]}\n{output}"
