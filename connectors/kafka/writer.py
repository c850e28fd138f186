"""The plain Kafka writer: a task's records through the worker process's shared producer.

Records are visible when acknowledged. A crash between the write and the runtime's
delivered-mark can leave a copy (same ID, same value), counted by ``onceflow status`` as a
possible copy. A broker that goes away under a write is waited for (:mod:`.outage`): what
Kafka did not take is sent again. A refused record batch is resent one record at a time to
find the culprits (:func:`culprits`). The transactional writer (:mod:`.transactional_writer`)
builds on this one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from onceflow.connectors.base import Rejected, SinkWriter, TaskInfo
from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.kafka.clients import (
    Delivery,
    KafkaUnavailable,
    Producer,
    ProducerBroken,
    RecordRefused,
    renew_shared_producer,
    shared_producer,
)
from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.outage import Wait, retrying, transient
from onceflow.connectors.kafka.serialization import RECORD_OVERHEAD_BYTES, record_size, too_big
from onceflow.kernel.errors import CodecError, ServiceError
from onceflow.kernel.records import Record

# A producer that answers no record for this long while some wait is replaced (see
# KafkaWriter._await_answers); it is flushed in slices this long meanwhile.
STUCK_S = 20.0
FLUSH_SLICE_S = 1.0
ABORT_TIMEOUT_S = 10.0
RESTAMPED = "restamped"  # the writer's counter of records stamped with the time of writing


class WritingSink(Protocol):
    """What the writers use of their :class:`~.sink.KafkaSink` (which imports this module)."""

    @property
    def topic(self) -> str:
        """The topic written."""

    @property
    def client(self) -> str:
        """The producer's library."""

    @property
    def timestamp(self) -> str:
        """``"event"`` or ``"write"``: what a record's Kafka timestamp is."""

    @property
    def max_request_size(self) -> int:
        """The producer's largest request, in bytes."""

    @property
    def transaction_prefix(self) -> str | None:
        """The prefix of the transactional ids."""

    @property
    def log_topic(self) -> str | None:
        """The delivery log topic (transactional sinks)."""

    @property
    def settings(self) -> KafkaSettings:
        """Connection settings."""

    @property
    def user_options(self) -> dict[str, Any]:
        """The producer options the user gave."""

    def producer_config(self, transactional_id: str | None = None) -> dict[str, Any]:
        """Settings of a producer of the sink."""

    def record(
        self, rec: Record, limit: int, keyed: bool = False
    ) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
        """Key, value and headers of one record."""

    def timestamp_of(self, rec: Record, now_ms: int) -> int | None:
        """The Kafka timestamp of a record (None: the time of writing)."""


class KafkaWriter(SinkWriter):
    """Sends a task's records through the worker's shared producer.

    A Kafka that goes away is waited for (see :mod:`.outage`): a send that cannot be queued
    and a record Kafka did not take (not refused for good) are tried again, with a new
    producer if the old one stopped making progress. A plain sink may so write a second copy
    of a record whose acknowledgement was lost (same ID, same value), as after a crash.
    """

    def __init__(self, sink: WritingSink, task: TaskInfo) -> None:
        self.sink = sink
        self.keyed = task.keyed
        self.config = {**sink.producer_config(), **sink.user_options}
        self.producer: Producer = retrying(
            sink.settings,
            f"writing to Kafka topic {sink.topic!r}",
            lambda: shared_producer(sink.client, sink.settings, self.config),
        )
        self.limit = sink.max_request_size - RECORD_OVERHEAD_BYTES
        self.sent: list[tuple[Record, Delivery]] = []
        self.stamped: set[int] = set()  # records (by id()) in flight with the time of writing
        self.restamped = 0  # ... of which the broker took this many, for good
        self.outage: Wait | None = None  # from a first failure until Kafka answers again

    def write(self, records: Sequence[Record]) -> list[Rejected]:
        """Queue the records, waiting for Kafka if need be; those it refuses for good."""
        rejected: list[Rejected] = []
        for rec in records:
            reason = self._send_waiting(rec)
            if reason is not None:
                rejected.append((rec, reason))
        return rejected

    def _send_waiting(self, rec: Record) -> str | None:
        """Queue one record, waiting for Kafka if need be; why it is refused for good, if it is."""
        while True:
            try:
                self._send(rec)
                return None
            except RecordRefused as exc:
                return str(exc)
            except Exception as exc:
                if not transient(exc):
                    raise
                self._waiting().failed(exc)

    def _send(self, rec: Record) -> None:
        """Encode and queue one record; :class:`RecordRefused` if it can never be written."""
        topic = self.sink.topic
        try:
            key, value, headers = self.sink.record(rec, self.limit, self.keyed)
        except CodecError as exc:
            msg = f"cannot write to Kafka topic {topic!r}: {exc}"
            raise RecordRefused(msg) from exc
        except ServiceError:  # a schema registry out of reach: not the record's fault
            raise
        except Exception as exc:  # noqa: BLE001 - the sink's key function failed on this record
            msg = f"cannot write to Kafka topic {topic!r}: {type(exc).__name__}: {exc}"
            raise RecordRefused(msg) from exc
        size = record_size(key, value, headers)
        if size > self.limit:
            raise RecordRefused(too_big(topic, size, self.sink.max_request_size))
        stamp = self.sink.timestamp_of(rec, int(time.time() * 1000))
        try:
            delivery = self.producer.send(topic, key, value, headers or None, stamp)
        except RecordRefused as exc:
            msg = f"Kafka topic {topic!r} refused the record: {exc}"
            raise RecordRefused(msg) from exc
        if stamp is None and rec.ts and self.sink.timestamp == "event":
            self.stamped.add(id(rec))
        self.sent.append((rec, delivery))

    def _waiting(self) -> Wait:
        """The wait for Kafka under way (one is begun at the first failure)."""
        if self.outage is None:
            self.outage = Wait(self.sink.settings, f"writing to Kafka topic {self.sink.topic!r}")
        return self.outage

    def flush(self) -> list[Rejected]:
        """Return once the broker acknowledged everything written.

        Records the broker refuses for good (too large for it, invalid) come back as
        rejected; records Kafka did not take otherwise are sent again once it answers (the
        run stops if it stays away past the outage bound). When the broker refused a record
        batch, the records that failed with it are sent again one at a time: the ones it
        refuses alone are the culprits (see :func:`culprits`).
        """
        rejected: list[Rejected] = []
        while self.sent:
            refused, failed = self._answers()
            if refused:
                certain, again = culprits(refused, failed)
                return rejected + certain + self._one_at_a_time(again)
            rejected += self._again(failed)
        self.outage = None
        return rejected

    def _answers(self) -> tuple[list[Rejected], list[tuple[Record, str]]]:
        """Wait for an answer to every record sent: those refused for good, those failed else.

        A producer that stopped making progress (see :meth:`_await_answers`) is replaced;
        what it did not answer counts as failed.
        """
        stuck = self._await_answers()
        outcomes = self._outcomes()
        if stuck:
            self._renew()
        return outcomes

    def _await_answers(self, *more: Delivery) -> bool:
        """Flush until every sent record (and ``more``) is answered; True if the producer got stuck.

        Stuck: no record answered for :data:`STUCK_S` while some wait, or the producer cannot
        go on (fenced, or in a fatal state). A client can hang on to
        records after a broker came back (kafka-python 3.0's transactional producer, measured:
        a batch added to the transaction while the coordinator was away is never sent, and
        expires after its 120 s delivery timeout); a new producer sends them at once.
        """
        deliveries = [delivery for _, delivery in self.sent] + list(more)
        answered = sum(d.done for d in deliveries)
        quiet_since = time.monotonic()
        while answered < len(deliveries):
            try:
                self.producer.flush(FLUSH_SLICE_S)
            except (KafkaUnavailable, ProducerBroken):
                return True  # it cannot go on: as good as stuck
            now = sum(d.done for d in deliveries)
            if now > answered:
                answered, quiet_since = now, time.monotonic()
                continue
            quiet = time.monotonic() - quiet_since
            if quiet > STUCK_S:
                return True
            if quiet > FLUSH_SLICE_S:
                left = len(deliveries) - answered
                self._waiting().note(f"{left} record(s) not acknowledged for {quiet:.0f} s")
        return False

    def _outcomes(self) -> tuple[list[Rejected], list[tuple[Record, str]]]:
        """Flushed sends the broker refused for good, and those that failed otherwise."""
        sent, self.sent = self.sent, []
        stamped, self.stamped = self.stamped, set()
        refused: list[Rejected] = []
        failed: list[tuple[Record, str]] = []
        restamped = 0
        for rec, delivery in sent:
            if not delivery.done:
                failed.append((rec, "no acknowledgement"))
                continue
            failure = delivery.failure
            if failure is None:
                restamped += id(rec) in stamped
                continue
            if delivery.poison:
                reason = f"Kafka topic {self.sink.topic!r} refused the record: {failure}"
                refused.append((rec, reason))
            else:
                failed.append((rec, failure))
        self._written_restamped(restamped)
        return refused, failed

    def _written_restamped(self, n: int) -> None:
        """``n`` records stamped with the time of writing were acknowledged (final here)."""
        self.restamped += n

    def counts(self) -> dict[str, int]:
        """``restamped``: records stamped with the time of writing, written for good."""
        return {RESTAMPED: self.restamped} if self.restamped else {}

    def _again(self, failed: list[tuple[Record, str]]) -> list[Rejected]:
        """Records Kafka did not take: wait for it, then send them again."""
        if not failed:
            return []
        why = f"{len(failed)} record(s) not written: {failed[0][1]}"
        self._waiting().failed(KafkaUnavailable(why))
        return self.write([rec for rec, _ in failed])

    def _renew(self) -> None:
        """Replace the process's shared producer, which stopped making progress."""
        old = self.producer
        while True:
            try:
                self.producer = renew_shared_producer(
                    self.sink.client, self.sink.settings, self.config, old
                )
                return
            except Exception as exc:
                if not transient(exc):
                    raise
                self._waiting().failed(exc)

    def _one_at_a_time(self, records: list[Record]) -> list[Rejected]:
        """Send each record in a request of its own; return those the broker refuses."""
        rejected: list[Rejected] = []
        for rec in records:
            reason = self._send_waiting(rec)
            if reason is not None:
                rejected.append((rec, reason))
                continue
            while self.sent:
                refused, failed = self._answers()
                rejected += refused
                rejected += self._again(failed)
        return rejected

    def close(self) -> None:
        """Flush; a record refused at this point is an error (no one is left to take it)."""
        leftover = self.flush()
        if leftover:
            first = leftover[0][1]
            msg = f"{len(leftover)} record(s) refused by {self.sink.topic!r} at close: {first}"
            raise ConnectorError(msg)

    def abort(self) -> None:
        """Wait a little for what is in flight (so that little of it lands after the attempt)."""
        try:
            self.producer.flush(ABORT_TIMEOUT_S)
        finally:
            self.sent = []
            self.stamped = set()


def culprits(
    refused: list[Rejected], failed: list[tuple[Record, str]]
) -> tuple[list[Rejected], list[Record]]:
    """Records refused for certain, and those to send again on their own to find out.

    kafka-python names the record that made the broker refuse a batch and fails the rest of
    the batch with another error (KIP-467); librdkafka gives every record of the batch the
    refusal. So one refused record is the culprit, while several may be one culprit and its
    batch; records that failed otherwise beside a refusal went down with its batch.
    """
    if len(refused) == 1:
        return refused, [rec for rec, _ in failed]
    return [], [rec for rec, _ in refused] + [rec for rec, _ in failed]
