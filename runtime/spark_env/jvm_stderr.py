"""The JVM's standard error, filtered before it reaches the terminal.

Spark's JVM inherits the driver's standard error, and so does everything the JVM starts: the
Python daemons of data source planners and streaming source runners (``pyspark.daemon``,
which :mod:`~.worker_daemon` cannot replace) print their workers' output
there. When a run stops, or fails and stops, the JVM closes those workers' sockets and a
worker that was flushing prints a ``BrokenPipeError`` traceback: pages of noise under the
one-line error a failed run is meant to read as. The JVM also prints a startup warning
about its vector module on every run.

:func:`filtered_stderr` hands the JVM a pipe instead. A thread copies every line to the run's
log file and passes it to the terminal unless :class:`StderrFilter` holds it back: the
vector-module warning, and whole tracebacks that end in a hung-up connection. Any other line
and any other traceback (a user's ``print`` in a map, a worker that fails otherwise, a JVM
that cannot start) still reaches the terminal.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator

QUIET_LINES = ("WARNING: Using incubator modules:",)
HANGUP_ERRORS = ("BrokenPipeError", "ConnectionResetError")
TRACEBACK_START = "Traceback (most recent call last):"
DAEMON_FLUSH_NOTE = "PySpark daemon failed to flush the output to the worker process:"
# Between two tracebacks of one chain (``raise ... from``, or an error while handling one).
CHAIN_LINES = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)
HOLD_FROM = (TRACEBACK_START, DAEMON_FLUSH_NOTE, *CHAIN_LINES)
MAX_HELD_LINES = 400  # a traceback longer than this is shown whatever it ends in
LAUNCH_FAILURE_WAIT = 2.0  # seconds to let a JVM that failed to start finish its output


class StderrFilter:
    """Line by line: every line to ``keep`` (the log), and most of them to ``show``.

    A traceback (from its header, a note introducing it or a chain line, to its exception
    line) is held; it is dropped if that exception is a hang-up, with the blank lines right
    after it, and shown otherwise. Of a chain, the part before a shown exception is shown.
    """

    def __init__(self, show: Callable[[bytes], None], keep: Callable[[bytes], None]) -> None:
        self._show = show
        self._keep = keep
        self._held: list[bytes] | None = None
        self._after_hidden = False  # blank lines after a hidden traceback are its own

    def feed(self, line: bytes) -> None:
        """One line, with its newline if it had one."""
        self._keep(line)
        text = line.decode("utf-8", "replace").rstrip("\r\n")
        if self._held is None:
            if self._after_hidden and not text.strip():
                return
            self._after_hidden = False
            if text in HOLD_FROM:
                self._held = [line]
            elif not text.startswith(QUIET_LINES):
                self._show(line)
            return
        self._held.append(line)
        inside = _inside_traceback(text) or text in CHAIN_LINES
        if inside and len(self._held) < MAX_HELD_LINES:
            return
        held, self._held = self._held, None
        self._after_hidden = text.startswith(HANGUP_ERRORS)
        if not self._after_hidden:
            for kept in held:
                self._show(kept)

    def close(self) -> None:
        """The stream ended: show what was held (a traceback cut short is not noise)."""
        held, self._held = self._held or [], None
        for line in held:
            self._show(line)


def _inside_traceback(text: str) -> bool:
    """A traceback's header or frame line; its exception line is the first one that is not."""
    return text == TRACEBACK_START or not text or text[0].isspace()


@contextlib.contextmanager
def filtered_stderr(log_path: str) -> Iterator[None]:
    """Processes started inside this block write their standard error through the filter.

    This process's own standard error is itself again when the block ends; the copying
    thread runs until the last process that inherited the pipe closes it, or until this
    process exits (what is still in the pipe then reaches neither the terminal nor the log:
    the JVM's own log has its errors). Without a standard error to filter (closed), the block
    does nothing.
    """
    if sys.stderr is None or not _is_open(2):
        yield
        return
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    terminal = os.dup(2)
    pump = threading.Thread(
        target=_copy, args=(read_end, terminal, log_path), name="onceflow-jvm-stderr", daemon=True
    )
    pump.start()
    saved = os.dup(2)
    failed = True
    try:
        os.dup2(write_end, 2)
        yield
        failed = False
    finally:
        os.close(write_end)  # fd 2 of the JVM (and, until restored, ours) keeps the pipe open
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        if failed:  # the JVM did not start: let its last words reach the terminal first
            pump.join(LAUNCH_FAILURE_WAIT)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _copy(read_end: int, terminal: int, log_path: str) -> None:
    """Copy the pipe line by line through a :class:`StderrFilter` until every writer is gone."""
    try:
        log = open(log_path, "ab", buffering=0)  # noqa: SIM115 - open as long as the JVM runs
    except OSError:
        log = None

    def show(line: bytes) -> None:
        with contextlib.suppress(OSError):
            os.write(terminal, line)

    def keep(line: bytes) -> None:
        if log is not None:
            with contextlib.suppress(OSError):
                log.write(line)

    lines = StderrFilter(show, keep)
    try:
        with os.fdopen(read_end, "rb", buffering=0) as stream:
            pending = b""
            while chunk := stream.read(65536):
                *complete, pending = (pending + chunk).split(b"\n")
                for line in complete:
                    lines.feed(line + b"\n")
            if pending:
                lines.feed(pending)
        lines.close()
    finally:
        if log is not None:
            log.close()
        os.close(terminal)
