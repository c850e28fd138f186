"""Nothing a benchmark starts outlives it: its end, an exception, Ctrl-C, SIGTERM or SIGHUP.

A benchmark's Redis and Kafka broker (``onceflow.testing``) and the systems it measures each
run in a session of their own, so that Ctrl-C in a terminal reaches the benchmark alone, which
then stops them. Nothing else stops them: they outlive a benchmark that dies without running
its ``with`` blocks and ``finally`` clauses, which is what Python does by default on SIGTERM
(``timeout``, a CI job cancelled, ``kill``) and SIGHUP (the terminal closed): no ``finally``,
no ``atexit``, the services left running.

* :func:`stopping_on_signals` turns SIGTERM and SIGHUP into ``SystemExit`` (Ctrl-C stays a
  ``KeyboardInterrupt``); the signals after the first are ignored while things stop;
* :func:`started` starts a service with its stop already registered, so a start cut short
  (a signal while the broker's JVM comes up) stops it too;
* :func:`own_session` runs a command in a session of its own and kills every process of that
  session on the way out (the command's JVMs and Python workers with it), whether it ended,
  timed out or the benchmark was stopped.

SIGKILL cannot be caught: a benchmark killed that way still leaves its services behind.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any, Protocol, TypeVar

from onceflow.testing.harness import kill_session

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Service(Protocol):
    def start(self) -> Any: ...

    def __exit__(self, *exc: object) -> Any: ...


S = TypeVar("S", bound=_Service)


class _StopOnce:
    """The first stop signal raises in the main thread; the later ones are ignored."""

    def __init__(self) -> None:
        self.received: int | None = None

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is not None:
            return  # already stopping: let the services stop in order
        self.received = signum
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)  # the shell's status for "killed by signum"


@contextlib.contextmanager
def stopping_on_signals() -> Iterator[None]:
    """Inside: SIGTERM and SIGHUP end the benchmark as an exception does, cleaning up.

    A signal that was ignored when the block began (``nohup``) stays ignored. Outside the
    main thread (which alone receives signals) or inside an outer such block, nothing changes.
    """
    outer = isinstance(signal.getsignal(signal.SIGTERM), _StopOnce)
    if outer or threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = _StopOnce()
    previous = {}
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, signal.SIG_DFL if old is None else old)


def started(stack: contextlib.ExitStack, service: S) -> S:
    """``service`` started, its ``__exit__`` on ``stack`` before the start (see the module)."""
    stack.push(service)
    service.start()
    return service


@contextlib.contextmanager
def own_session(cmd: list[str], **popen: Any) -> Iterator[subprocess.Popen[Any]]:
    """``cmd`` in a new session; on leaving, every process of that session is killed."""
    with subprocess.Popen(cmd, start_new_session=True, **popen) as proc:
        try:
            yield proc
        finally:
            kill_session(proc.pid)
