"""Waiting for a Kafka that does not answer: bounded, with a progress line, then one clear error.

A broker restarted (killed and back within a minute, or each node of a cluster in turn) is
an outage, not a failure of the run: every Kafka step of a running pipeline (planning
offsets on the driver, a task reading its range, the sinks' writes and transactions, the
delivery markers, the dead letters) retries what failed for as long as
:attr:`~onceflow.connectors.kafka.connection.KafkaSettings.outage_wait_s` (default 180 s,
``$ONCEFLOW_KAFKA_OUTAGE_WAIT`` or ``onceflow run --kafka-outage-wait``) from the first
failure, and a run's first connection for
:attr:`~onceflow.connectors.kafka.connection.KafkaSettings.start_wait_s` (default 60 s,
``$ONCEFLOW_KAFKA_START_WAIT``, ``--kafka-start-wait``). Meanwhile a progress line goes to
standard error (and the log) every :data:`PROGRESS_EVERY_S`; past the bound the step raises
:class:`~.interface.KafkaUnavailable`, whose message is the one line the run ends with:
which servers, for how long, the last error, what to check.

What counts as an outage (:func:`transient`): the client libraries' retriable errors (no
broker, a connection lost or refused, a request timed out, a leader or coordinator moving,
too few in-sync replicas) and :class:`~.interface.KafkaUnavailable`, which the clients'
adapters and the sink raise for what they see of it (records not acknowledged while Kafka
is silent, a producer that stopped making progress). Anything else (authorization, a
record refused for good, a bad setting) fails at once, as before.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import TypeVar

from onceflow.connectors.kafka.connection import (
    KAFKA_OUTAGE_WAIT_ENV,
    KAFKA_START_WAIT_ENV,
    KafkaSettings,
)
from onceflow.connectors.kafka.interface import KafkaUnavailable

LOG = logging.getLogger("onceflow.kafka")
# Kafka's own chatter while a broker is away (librdkafka logs through a child of this logger)
# goes to the driver's log file, never to a worker's standard error by Python's last resort:
# the progress line is what the terminal shows.
LOG.addHandler(logging.NullHandler())
T = TypeVar("T")

PROGRESS_EVERY_S = 10.0  # a progress line this often while waiting
FIRST_LINE_S = 2.0  # the first one once a wait has lasted this long (a blip stays silent)
BACKOFF_S = (0.1, 0.25, 0.5, 1.0, 2.0)  # between attempts; the last one repeats
# How long one attempt may block inside a client (bootstrap, a metadata or offsets request,
# registering a transactional id), so that a progress line comes on time.
ATTEMPT_S = 10.0
MAX_ERROR_CHARS = 300


def transient(exc: BaseException) -> bool:
    """Whether a failure of a Kafka client may go away by itself (see the module docstring)."""
    if isinstance(exc, KafkaUnavailable):
        return True
    from kafka.errors import KafkaError

    return isinstance(exc, KafkaError) and bool(getattr(exc, "retriable", False))


def describe(exc: BaseException) -> str:
    """An error as one short line (the type and the first of its text)."""
    text = " ".join(str(exc).split())
    name = type(exc).__name__
    if not text.startswith(name):
        text = f"{name}: {text}" if text else name
    return text[:MAX_ERROR_CHARS]


class Wait:
    """One wait for Kafka, from its first failure to success or the bound.

    ``doing`` says what waits ("writing to topic 'out'"); ``start`` marks a run's first
    connection (bounded by ``start_wait_s`` instead of ``outage_wait_s``). :meth:`failed`
    backs off after a failed attempt; :meth:`note` only counts time (a poll that came back
    empty while Kafka is away). Both print the progress line when it is due and raise
    :class:`KafkaUnavailable` once the bound has passed.
    """

    def __init__(self, settings: KafkaSettings, doing: str, start: bool = False) -> None:
        self.settings = settings
        self.doing = doing
        self.start = start
        self.bound_s = settings.start_wait_s if start else settings.outage_wait_s
        self.began = time.monotonic()
        self.attempts = 0
        self.next_line = self.began + FIRST_LINE_S
        self.last = "no answer"

    @property
    def waited_s(self) -> float:
        """Seconds since the wait began."""
        return time.monotonic() - self.began

    @property
    def left_s(self) -> float:
        """Seconds left before the bound (never below zero)."""
        return max(0.0, self.bound_s - self.waited_s)

    def note(self, why: str) -> None:
        """Kafka is still away (``why``): a progress line when due; raise past the bound."""
        self.last = why[:MAX_ERROR_CHARS]
        now = time.monotonic()
        if now - self.began > self.bound_s:
            raise KafkaUnavailable(self.give_up_line())
        if now >= self.next_line:
            self.next_line = now + PROGRESS_EVERY_S
            say(self.progress_line())

    def failed(self, exc: BaseException) -> None:
        """An attempt failed with a transient error: note it, then back off before the next."""
        self.note(describe(exc))
        pause = BACKOFF_S[min(self.attempts, len(BACKOFF_S) - 1)]
        self.attempts += 1
        time.sleep(min(pause, max(0.0, self.bound_s - self.waited_s) + 0.01))

    def progress_line(self) -> str:
        """``waiting for Kafka at ... (doing): N s so far, giving up after M s; last: ...``."""
        return (
            f"onceflow: waiting for Kafka at {self.settings.bootstrap_servers} ({self.doing}): "
            f"{self.waited_s:.0f} s so far, giving up after {self.bound_s:.0f} s; "
            f"last: {self.last}"
        )

    def give_up_line(self) -> str:
        """The one line a run ends with when Kafka stayed away past the bound."""
        variable = KAFKA_START_WAIT_ENV if self.start else KAFKA_OUTAGE_WAIT_ENV
        flag = "--kafka-start-wait" if self.start else "--kafka-outage-wait"
        return (
            f"Kafka at {self.settings.bootstrap_servers} did not answer for "
            f"{self.bound_s:.0f} s while {self.doing} (last: {self.last}); check that the "
            "brokers are up and reachable from here and that KAFKA_BOOTSTRAP_SERVERS (or "
            f"bootstrap_servers=) names them; to wait longer set {variable} or {flag}"
        )


def retrying(
    settings: KafkaSettings,
    doing: str,
    call: Callable[[], T],
    *,
    start: bool = False,
    is_transient: Callable[[BaseException], bool] = transient,
    on_failure: Callable[[], None] | None = None,
) -> T:
    """``call()``, again after each transient failure until it succeeds or the bound passes.

    ``on_failure`` runs after each failed attempt (drop a client that may be broken).
    """
    wait: Wait | None = None
    while True:
        try:
            return call()
        except Exception as exc:
            if not is_transient(exc):
                raise
            if wait is None:
                wait = Wait(settings, doing, start)
            if on_failure is not None:
                on_failure()
            wait.failed(exc)


def say(line: str) -> None:
    """A progress line: to standard error (the terminal, from any process of the run) and the log.

    The log is the driver's log file; a worker has none (see :data:`LOG`).
    """
    LOG.warning("%s", line)
    print(line, file=sys.stderr, flush=True)
