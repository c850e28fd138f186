"""The time a micro-batch starts at: Redis's clock, checked against two others.

A batch's time (fixed by its first attempt, see :mod:`~.batch`) decides when keyed state
with a ``ttl`` ends, when early panes by processing time fire and which records are too far
ahead of the clock to admit. It comes from Redis's clock (one clock for every driver and GC)
and never goes back. A clock that lies would do lasting harm: one that jumped a week ahead
would end every piece of state with a shorter ``ttl`` for good (the batch time never comes
back), one an hour behind would turn every record stamped now into a dead letter "ahead of
the clock". So before a new batch takes a time:

* Redis's clock is compared with the driver machine's: if they disagree by more than
  ``EventTime.max_clock_skew`` (a minute by default) the batch does not start, and the run
  stops saying which clock says what (:class:`ClockSkewError`); fix the one that is wrong;
* within a run, the batch time moves on by at most the time that really passed since the
  last batch (the driver's monotonic clock, which no clock step moves) plus that skew: a clock
  that jumped ahead on both machines at once (the same host) is followed slowly, not at once.

A stored batch time ahead of both clocks (left by such a jump before) holds the batch time
still until the clocks catch up; the run says so once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from onceflow.kernel.errors import ServiceError

log = logging.getLogger(__name__)


class ClockSkewError(ServiceError):
    """Redis's clock and the driver machine's disagree too much for a batch to start."""


def _utc(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ms / 1000))


def _span(ms: int) -> str:
    seconds = abs(ms) // 1000
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds / 3600:.1f} h"


@dataclass
class BatchClock:
    """Where a driver's batch times come from (see the module docstring)."""

    max_skew_ms: int
    last: tuple[int, float] | None = None  # the last new batch's time, and monotonic seconds
    said_ahead: bool = False

    def now(self, redis_ms: int, stored_ms: int, local_ms: int | None = None) -> int:
        """The time of a new batch, from Redis's clock now and the stored batch time."""
        local = int(time.time() * 1000) if local_ms is None else local_ms
        if abs(redis_ms - local) > self.max_skew_ms:
            raise ClockSkewError(skew_message(redis_ms, local, self.max_skew_ms))
        candidate = redis_ms
        if self.last is not None:
            last_ms, last_mono = self.last
            passed = int((time.monotonic() - last_mono) * 1000)
            candidate = min(candidate, last_ms + passed + self.max_skew_ms)
        if stored_ms > candidate + self.max_skew_ms and not self.said_ahead:
            self.said_ahead = True
            log.warning(
                "the stored batch time %s is %s ahead of the clocks (%s): batch time holds "
                "still until they catch up",
                _utc(stored_ms),
                _span(stored_ms - candidate),
                _utc(candidate),
            )
        now = max(candidate, stored_ms)
        self.last = (now, time.monotonic())
        return now


def skew_message(redis_ms: int, local_ms: int, max_skew_ms: int) -> str:
    """What a run says when the clocks disagree, and what to do."""
    which = "ahead of" if redis_ms > local_ms else "behind"
    return (
        f"Redis's clock ({_utc(redis_ms)}) is {_span(redis_ms - local_ms)} {which} this "
        f"machine's ({_utc(local_ms)}), more than the {_span(max_skew_ms)} allowed: batch "
        "times decide when state with a ttl ends and which records are too far ahead to "
        "admit, and a wrong one does lasting harm, so no micro-batch starts. Fix the clock "
        "that is wrong (NTP), or raise EventTime.of(max_clock_skew=...)"
    )
