"""Where a task's wall time goes, step by step: opt-in, for benchmarks (``ONCEFLOW_TASK_TIMES=1``).

``bench/latency.py --phases`` sets the variable for the run it measures; each task then
adds, per step, the microseconds it spent there to its stage's counters
(``<stage>/time_us/<step>``, summed over the batch's tasks like every counter and logged
with the batch), beside ``time_us/task`` (the whole task, from its function's first call to
its end) and ``tasks``. The steps are leaf calls (reading input, the Redis admit and commit,
the Kafka transaction's write, prepare and commit, ...), so they do not overlap; what no step
covers is the stage's own code and the hand-over to Spark. Without the variable nothing is
timed: :func:`timed` is then a no-op context manager.

Monitoring only: timing never changes what a task does, in which order, or what it commits.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import TypeVar

ENV = "ONCEFLOW_TASK_TIMES"
PREFIX = "time_us/"
T = TypeVar("T")


class TaskTimes:
    """Microseconds per step of the running task."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.us: dict[str, int] = {}

    def add(self, step: str, seconds: float) -> None:
        """``seconds`` more spent in ``step``."""
        self.us[step] = self.us.get(step, 0) + int(seconds * 1_000_000)

    def counters(self) -> dict[str, int]:
        """The task's counters: each step, the whole task, one task."""
        out = {PREFIX + k: v for k, v in self.us.items()}
        out[PREFIX + "task"] = int((time.perf_counter() - self.started) * 1_000_000)
        out["tasks"] = 1
        return out


_current: TaskTimes | None = None


def begin() -> TaskTimes | None:
    """Start timing a task in this worker (None when timing is off)."""
    global _current  # noqa: PLW0603 - one task at a time per Python worker
    _current = TaskTimes() if os.environ.get(ENV) == "1" else None
    return _current


def end() -> None:
    """The task ended: later calls are not timed."""
    global _current  # noqa: PLW0603
    _current = None


@contextlib.contextmanager
def timed(step: str) -> Iterator[None]:
    """Count the time of the ``with`` block towards ``step`` (when timing is on)."""
    times = _current
    if times is None:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        times.add(step, time.perf_counter() - start)


def timed_iter(step: str, items: Iterator[T]) -> Iterator[T]:
    """``items``, with the time spent producing each counted towards ``step``."""
    if _current is None:
        yield from items
        return
    while True:
        with timed(step):
            try:
                item = next(items)
            except StopIteration:
                return
        yield item
