"""The :mod:`.interface` over kafka-python: the default client, ``client="python"``.

Imported everywhere (kafka-python is a dependency); the library itself only when a client is
created, on the worker that needs it.
"""

from __future__ import annotations

from typing import Any

from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.interface import (
    NOTHING,
    READ_BATCH,
    Delivery,
    Fetched,
    Headers,
    KafkaUnavailable,
    OffsetOutOfRange,
    ProducerBroken,
    ProducerFenced,
    RecordRefused,
)
from onceflow.connectors.kafka.outage import ATTEMPT_S, transient

# kafka-python's errors after which the same record would be refused again.
POISON_ERRORS = frozenset(
    {
        "MessageSizeTooLargeError",
        "RecordTooLargeError",
        "InvalidRecordError",
        "CorruptRecordError",
        "RecordListTooLargeError",
        "InvalidTimestampError",  # further from the broker's clock than it accepts
    }
)
# kafka-python's errors of a producer whose transactional id another producer registered.
FENCED_ERRORS = frozenset({"ProducerFencedError", "InvalidProducerEpochError", "IllegalStateError"})
ATTEMPT_MS = int(ATTEMPT_S * 1000)
# How long creating a client may wait for a first broker (kafka-python's default is 30 s):
# a wait for Kafka then says so every ATTEMPT_S (see .outage).
BOOTSTRAP = {"bootstrap_timeout_ms": ATTEMPT_MS}
FORCE_CLOSE_S = 5.0  # how long a producer's I/O thread may take to stop when told to


def translated(exc: Exception) -> Exception:
    """A kafka-python error as :class:`ProducerFenced` or :class:`KafkaUnavailable` if it is one.

    Anything else is returned as it is.
    """
    if type(exc).__name__ in FENCED_ERRORS:
        return ProducerFenced(str(exc))
    if transient(exc):
        return KafkaUnavailable(str(exc))
    return exc


class PythonReader:
    """:class:`~.interface.PartitionReader` over a kafka-python ``KafkaConsumer``."""

    def __init__(self, settings: KafkaSettings) -> None:
        from kafka import KafkaConsumer

        self.consumer = KafkaConsumer(
            **{**BOOTSTRAP, **settings.client_config()},
            enable_auto_commit=False,
            max_poll_records=READ_BATCH,
            group_id=None,
            auto_offset_reset="none",  # out of range raises: never jump over records
            isolation_level="read_committed",  # never records of aborted or open transactions
        )
        self.tp: Any = None

    def log_start(self, topic: str, partition: int) -> int:
        """The first offset still in the partition's log."""
        from kafka import TopicPartition

        tp = TopicPartition(topic, partition)
        try:
            return int(self.consumer.beginning_offsets([tp], timeout_ms=ATTEMPT_MS)[tp])
        except Exception as exc:
            raise translated(exc) from exc

    def seek(self, topic: str, partition: int, offset: int) -> None:
        """Read this partition (and only it) from ``offset`` on."""
        from kafka import TopicPartition

        self.tp = TopicPartition(topic, partition)
        self.consumer.assign([self.tp])
        self.consumer.seek(self.tp, offset)

    def poll(self, timeout_s: float) -> Fetched:
        """The next records of the partition."""
        from kafka.errors import OffsetOutOfRangeError

        try:
            rows = self.consumer.poll(timeout_ms=int(timeout_s * 1000)).get(self.tp)
        except OffsetOutOfRangeError as exc:
            raise OffsetOutOfRange(str(exc)) from exc
        if not rows:
            return NOTHING
        return Fetched(
            [r.offset for r in rows],
            [r.timestamp for r in rows],
            [r.key for r in rows],
            [r.value for r in rows],
            [r.headers for r in rows],
        )

    def position(self) -> int | None:
        """The offset the next read starts at, if known."""
        try:
            return int(self.consumer.position(self.tp, timeout_ms=ATTEMPT_MS))
        except Exception as exc:
            raise translated(exc) from exc

    def release(self) -> None:
        """Nothing to do: kafka-python fetches only while polled."""

    def close(self) -> None:
        """Release the client."""
        self.consumer.close()


class PythonDelivery:
    """:class:`~.interface.Delivery` of a kafka-python send (its future)."""

    __slots__ = ("future",)

    def __init__(self, future: Any) -> None:
        self.future = future

    @property
    def done(self) -> bool:
        """Whether the broker answered (or the client gave up)."""
        return bool(self.future.is_done)

    @property
    def failure(self) -> str | None:
        """Why the record was not written; None when acknowledged or not done."""
        if not self.future.is_done or not self.future.failed():
            return None
        return str(self.future.exception or "no acknowledgement")

    @property
    def poison(self) -> bool:
        """Whether the broker refused the record for good."""
        error = self.future.exception if self.future.is_done else None
        return error is not None and type(error).__name__ in POISON_ERRORS

    def where(self, timeout_s: float = 120) -> tuple[str, int, int]:
        """Topic, partition and offset of the acknowledged record."""
        meta = self.future.get(timeout=timeout_s)
        return meta.topic, meta.partition, meta.offset


class PythonProducer:
    """:class:`~.interface.Producer` over a kafka-python ``KafkaProducer``."""

    def __init__(self, settings: KafkaSettings, config: dict[str, Any]) -> None:
        from kafka import KafkaProducer

        self.producer = KafkaProducer(**{**BOOTSTRAP, **settings.client_config(), **config})
        # the end of a transaction asked for and not answered yet: (committed, its result)
        self._ending: tuple[bool, Any] | None = None

    def send(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Headers | None,
        timestamp_ms: int | None,
    ) -> Delivery:
        """Queue a record."""
        from kafka.errors import MessageSizeTooLargeError

        try:
            future = self.producer.send(
                topic, value=value, key=key, headers=headers or None, timestamp_ms=timestamp_ms
            )
        except MessageSizeTooLargeError as exc:
            raise RecordRefused(str(exc)) from exc
        except Exception as exc:
            raise translated(exc) from exc
        return PythonDelivery(future)

    def flush(self, timeout_s: float) -> None:
        """Wait (at most about ``timeout_s``) until every queued record is answered.

        kafka-python raises when a record batch is not done in time; what is not done is
        read from the deliveries instead.
        """
        from kafka.errors import KafkaTimeoutError

        try:
            self.producer.flush(timeout=timeout_s)
        except KafkaTimeoutError:
            pass

    def init_transactions(self, timeout_s: float) -> None:
        """Register the transactional id (fences older producers of it).

        kafka-python waits ``max_block_ms`` (set to ``timeout_s`` by the sink) and keeps the
        request: asked again after a timeout, it goes on waiting for the same answer.
        """
        del timeout_s
        try:
            self.producer.init_transactions()
        except Exception as exc:
            raise translated(exc) from exc

    def begin(self) -> None:
        """Begin a transaction."""
        try:
            self.producer.begin_transaction()
        except Exception as exc:
            raise translated(exc) from exc

    def commit(self, timeout_s: float) -> None:
        """Commit the open transaction, waiting at most ``timeout_s`` for the answer.

        Asked again after a timeout, it waits for the same commit's answer.
        """
        self._end(committed=True, timeout_s=timeout_s)

    def abort(self, timeout_s: float) -> None:
        """Abort the open transaction, waiting at most ``timeout_s`` for the answer."""
        self._end(committed=False, timeout_s=timeout_s)

    def _end(self, committed: bool, timeout_s: float) -> None:
        """``commit_transaction``/``abort_transaction``, with a bound on the wait.

        kafka-python 3's own methods wait for the coordinator's answer without a limit (for
        ever, while a broker is away); these are their bodies with one, and the request is
        kept for the next call to wait on.
        """
        producer = self.producer
        manager = getattr(producer, "_transaction_manager", None)
        sender = getattr(producer, "_sender", None)
        try:
            if manager is None or sender is None:  # another kafka-python: its own, unbounded
                end = producer.commit_transaction if committed else producer.abort_transaction
                end()
                return
            if self._ending is None or self._ending[0] != committed:
                result = manager.begin_commit() if committed else manager.begin_abort()
                self._ending = (committed, result)
                sender.wakeup()
            answered = self._ending[1].wait(timeout_ms=timeout_s * 1000)
        except Exception as exc:  # it failed for good: this producer cannot go on
            self._ending = None
            if type(exc).__name__ in FENCED_ERRORS:
                raise ProducerFenced(str(exc)) from exc
            raise ProducerBroken(str(exc)) from exc
        if not answered:
            what = "commit" if committed else "abort"
            msg = f"Kafka did not answer the transaction's {what} within {timeout_s:.0f} s"
            raise KafkaUnavailable(msg)
        self._ending = None

    def close(self, timeout_s: float) -> None:
        """Release the client (at once with ``timeout_s`` 0: what is unsent is dropped).

        kafka-python's ``close`` flushes first and gives up there, the producer still open,
        when records are unanswered in time (a broker away): its I/O thread is then stopped
        without sending them, which fails them, and the close goes through.
        """
        from kafka.errors import KafkaTimeoutError

        if timeout_s <= 0:
            self._force_close()
        try:
            self.producer.close(timeout=timeout_s)
        except KafkaTimeoutError:
            self._force_close()
            self.producer.close(timeout=0)

    def _force_close(self) -> None:
        sender = getattr(self.producer, "_sender", None)
        if sender is not None and sender.is_alive():
            sender.force_close()
            sender.join(FORCE_CLOSE_S)
