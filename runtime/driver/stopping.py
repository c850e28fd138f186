"""Stopping a streaming run between micro-batches: on SIGTERM or SIGINT, or when it is time.

A stop request lets the micro-batch under way finish (its sinks written, Redis committed,
Spark's commit log written) and starts no new one: the driver stops the query as soon as no
trigger is active, and a micro-batch Spark begins anyway fails on entry before doing anything
(the next run plans it again, with the same offsets). The run then ends normally, so
``onceflow run`` exits 0. A second signal aborts at once (``KeyboardInterrupt``): still
exactly-once, since a micro-batch cut short is replayed from the checkpoint on the next start,
but its work is done twice.

Signal handlers are installed only in the main thread, and the previous ones come back when
the run ends.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

# In the text of the query's failure when a micro-batch refused to start because of a stop.
STOP_MARK = "onceflow: stop requested before the micro-batch started"
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequested(Exception):  # noqa: N818 - a request, not an error
    """Raised by a micro-batch that starts after a stop was requested (it did nothing)."""

    def __init__(self) -> None:
        super().__init__(STOP_MARK)


class StopRequest:
    """Whether, and why, a run should stop after the current micro-batch."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.signals = 0
        self.event = threading.Event()

    @property
    def requested(self) -> bool:
        """A stop was asked for."""
        return self.reason is not None

    def request(self, reason: str) -> None:
        """Ask for a stop (the first reason is kept)."""
        if self.reason is None:
            self.reason = reason
            log.info("stop requested: %s", reason)
        self.event.set()

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``, less if a stop is requested; whether one was."""
        return self.event.wait(seconds)


class SignalHandlers:
    """SIGTERM and SIGINT request a stop; a second one aborts (``KeyboardInterrupt``).

    PySpark installs a SIGINT handler of its own when a SparkContext starts (it cancels every
    job and raises ``KeyboardInterrupt``): :meth:`install` again once the session is up.
    :meth:`restore` puts back, per signal, the handler the last :meth:`install` displaced.
    """

    def __init__(self, stop: StopRequest, say: Callable[[str], None]) -> None:
        self.stop = stop
        self.say = say
        self.previous: dict[signal.Signals, Any] = {}

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        """The signal handler."""
        name = signal.Signals(signum).name
        self.stop.signals += 1
        if self.stop.signals > 1:
            log.warning("%s again: aborting", name)
            raise KeyboardInterrupt
        self.stop.request(name)
        self.say(
            f"{name}: finishing the current micro-batch, then stopping (send it again to abort)"
        )

    def install(self) -> None:
        """Handle the signals here (only the main thread can)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s in SIGNALS:
            displaced = signal.signal(s, self.handle)
            if displaced != self.handle:
                self.previous[s] = displaced

    def restore(self) -> None:
        """Give the signals back."""
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous.clear()


@contextmanager
def stop_on_signals(stop: StopRequest, say: Callable[[str], None]) -> Iterator[SignalHandlers]:
    """Signal handlers that request ``stop`` for the duration of a run."""
    handlers = SignalHandlers(stop, say)
    handlers.install()
    try:
        yield handlers
    finally:
        handlers.restore()
