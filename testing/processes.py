"""The processes of the local clusters: each started in a session of its own and tracked.

:func:`start_in_session` starts a server in a new session with its output in a log file;
:func:`kill_tree` SIGKILLs it whole (its session and its descendants, as a node loss would),
and the end of the interpreter kills whatever is left, so no executor or Python worker
outlives its cluster.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from onceflow.kernel.errors import ServiceError

T = TypeVar("T")

LOOPBACK = "127.0.0.1"
POLL_INTERVAL_S = 0.1
KILL_TIMEOUT_S = 10.0
"""How long SIGKILLed processes get to disappear from the process table."""
PORT_ATTEMPTS = 5
"""A port picked by ``free_port`` can be taken before the server binds it: retry elsewhere."""
LOG_TAIL_LINES = 25

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


def kill_tree(proc: subprocess.Popen[bytes]) -> dict[int, str]:
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
            kill_tree(proc)


def start_in_session(
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


def running(proc: subprocess.Popen[bytes] | None) -> bool:
    """Whether ``proc`` was started and has not exited."""
    return proc is not None and proc.poll() is None


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of a log, indented, for an error message."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "    (no log)"
    return "\n".join("    " + line for line in text.splitlines()[-lines:])


def wait_for(check: Callable[[], T | None], timeout: float, failure: Callable[[], str]) -> T:
    """Poll ``check`` until it returns a value; ``failure()`` is the message on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise ServiceError(failure())
        time.sleep(POLL_INTERVAL_S)


def executable(name: str, package_hint: str) -> str:
    """The path of program ``name``; a clear error naming what to install when it is missing."""
    path = shutil.which(name)
    if path is None:
        msg = f"{name} is not on PATH; install it ({package_hint}) and try again"
        raise ServiceError(msg)
    return path
