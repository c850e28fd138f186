"""The :mod:`.interface` over kafka-python: the default client, ``client="python"``.

Imported everywhere (kafka-python is a dependency); the library itself only when a client is
created, on the worker that needs it.
"""

from __future__ import annotations

from typing import Any

from onceflow.connectors.kafka.interface import (
    NOTHING,
    READ_BATCH,
    Delivery,
    Fetched,
    Headers,
    OffsetOutOfRange,
    ProducerFenced,
    RecordRefused,
)
from onceflow.kernel.settings import KafkaSettings

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


class PythonReader:
    """:class:`~.interface.PartitionReader` over a kafka-python ``KafkaConsumer``."""

    def __init__(self, settings: KafkaSettings) -> None:
        from kafka import KafkaConsumer

        self.consumer = KafkaConsumer(
            **settings.client_config(),
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
        return int(self.consumer.beginning_offsets([tp])[tp])

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
        return int(self.consumer.position(self.tp))

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

        self.producer = KafkaProducer(**{**settings.client_config(), **config})

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
        return PythonDelivery(future)

    def flush(self, timeout_s: float) -> None:
        """Wait until every queued record is acknowledged or failed."""
        self.producer.flush(timeout=timeout_s)

    def init_transactions(self) -> None:
        """Register the transactional id (fences older producers of it)."""
        self.producer.init_transactions()

    def begin(self) -> None:
        """Begin a transaction."""
        try:
            self.producer.begin_transaction()
        except Exception as exc:
            if type(exc).__name__ not in FENCED_ERRORS:
                raise
            raise ProducerFenced(str(exc)) from exc

    def commit(self) -> None:
        """Commit the open transaction."""
        self.producer.commit_transaction()

    def abort(self) -> None:
        """Abort the open transaction."""
        self.producer.abort_transaction()

    def close(self, timeout_s: float) -> None:
        """Release the client."""
        self.producer.close(timeout=timeout_s)
