"""The :mod:`.interface` over confluent-kafka (librdkafka): ``client="confluent"``.

Imported only when a source or sink asks for this client, on the worker that creates one.

**Settings** are translated by :mod:`.confluent_config`; nothing here prints a setting's
value.

**Differences that matter, handled here:**

* librdkafka reports a record batch the broker refused (for instance one record in it with a
  timestamp the topic does not accept) as the same error on *every* record of the batch,
  where kafka-python names the culprit (KIP-467). Such errors are marked
  :attr:`~.interface.Delivery.poison` all the same; the sink's writer then sends each record on
  its own to find the culprits (``connectors/kafka/writer.py``).
* ``produce`` raises ``BufferError`` when its local queue is full: the producer serves
  deliveries until there is room (or gives up after :data:`QUEUE_FULL_S`).
* A consumer needs a ``group.id`` even when it only assigns partitions; the reader never
  joins the group nor commits to it.
* A partition read past its log start raises nothing by itself; ``auto.offset.reset=error``
  makes it an error event, raised as :class:`~.interface.OffsetOutOfRange`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka import KafkaError as E  # noqa: N814 - error codes read as E.CODE
from confluent_kafka import Producer as LibProducer

from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.kafka.confluent_config import (
    CONSUMER_NAMES,
    PRODUCER_NAMES,
    librdkafka_config,
)
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
from onceflow.connectors.kafka.outage import ATTEMPT_S

LOG = logging.getLogger("onceflow.kafka.librdkafka")

READER_GROUP = "onceflow-reader"  # required by librdkafka; never joined (assign only)
# How much a reader fetches ahead of what it was asked for (librdkafka's default, 64 MiB a
# partition, reads far past the end of a micro-batch's range).
READER_QUEUE_KBYTES = 16 * 1024
READER_QUEUE_MESSAGES = 4 * READ_BATCH
# How long the fetcher pauses once that much is queued. librdkafka's default, 1 s, left the
# reader idle after every READER_QUEUE_MESSAGES records (measured: 47k records/s instead of
# ~300k reading 50k records of one partition).
READER_QUEUE_BACKOFF_MS = 10
# A reader reads ranges known to be there: waiting at a partition's end for more is useless,
# and a fetch waiting there holds up the next partition's first fetch (librdkafka's default,
# 500 ms, cost every task half a second).
READER_FETCH_WAIT_MS = 10
LIST_TIMEOUT_S = ATTEMPT_S
QUEUE_FULL_S = ATTEMPT_S


def _codes() -> tuple[frozenset[int], frozenset[int], frozenset[int], frozenset[int]]:
    poison = frozenset(
        {
            E.MSG_SIZE_TOO_LARGE,
            E.INVALID_MSG,  # corrupt record
            E.INVALID_MSG_SIZE,
            E.INVALID_RECORD,
            E.RECORD_LIST_TOO_LARGE,
            E.INVALID_TIMESTAMP,  # further from the broker's clock than it accepts
        }
    )
    out_of_range = frozenset({E._AUTO_OFFSET_RESET, E.OFFSET_OUT_OF_RANGE})
    denied = frozenset(
        {
            E.TOPIC_AUTHORIZATION_FAILED,
            E.CLUSTER_AUTHORIZATION_FAILED,
            E.SASL_AUTHENTICATION_FAILED,
            E._AUTHENTICATION,
            E.UNKNOWN_TOPIC_OR_PART,
        }
    )
    fenced = frozenset({E._FENCED, E.PRODUCER_FENCED, E.INVALID_PRODUCER_EPOCH})
    return poison, out_of_range, denied, fenced


POISON_CODES, OUT_OF_RANGE_CODES, DENIED_CODES, FENCED_CODES = _codes()
# librdkafka's codes of a Kafka that is away or moving (some are not flagged retriable).
TRANSIENT_CODES = frozenset(
    {
        E._TRANSPORT,
        E._ALL_BROKERS_DOWN,
        E._DESTROY_BROKER,
        E._TIMED_OUT,
        E._MSG_TIMED_OUT,
        E._RESOLVE,
        E._WAIT_COORD,
        E.NOT_COORDINATOR,
        E.COORDINATOR_NOT_AVAILABLE,
        E.COORDINATOR_LOAD_IN_PROGRESS,
        E.NOT_ENOUGH_REPLICAS,
        E.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
        E.REQUEST_TIMED_OUT,
        E.NOT_LEADER_FOR_PARTITION,
        E.LEADER_NOT_AVAILABLE,
        E.CONCURRENT_TRANSACTIONS,
    }
)


# -- reading ----------------------------------------------------------------------------------


class ConfluentReader:
    """:class:`~.interface.PartitionReader` over a confluent-kafka ``Consumer``."""

    def __init__(self, settings: KafkaSettings) -> None:
        config: dict[str, Any] = {
            "fetch.wait.max.ms": READER_FETCH_WAIT_MS,
            "queued.max.messages.kbytes": READER_QUEUE_KBYTES,
            "queued.min.messages": READER_QUEUE_MESSAGES,
            "fetch.queue.backoff.ms": READER_QUEUE_BACKOFF_MS,
        }
        config.update(librdkafka_config(settings, {}, CONSUMER_NAMES, "KafkaSource"))
        config.update(
            {
                "group.id": READER_GROUP,
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "auto.offset.reset": "error",  # out of range raises: never jump over records
                "isolation.level": "read_committed",  # never aborted or open transactions
                "logger": LOG,
            }
        )
        self.consumer = Consumer(config)
        self.tp: Any = None

    def log_start(self, topic: str, partition: int) -> int:
        """The first offset still in the partition's log."""
        tp = TopicPartition(topic, partition)
        try:
            low, _ = self.consumer.get_watermark_offsets(tp, timeout=LIST_TIMEOUT_S, cached=False)
        except KafkaException as exc:
            error = exc.args[0]
            text = f"reading {topic}:{partition} failed: {error.name()}: {error.str()}"
            if error.fatal() or error.code() in DENIED_CODES:
                raise ConnectorError(text) from None
            raise KafkaUnavailable(text) from None  # a broker away or moving: asked again
        return int(low)

    def seek(self, topic: str, partition: int, offset: int) -> None:
        """Read this partition (and only it) from ``offset`` on."""
        self.tp = TopicPartition(topic, partition)
        self.consumer.assign([TopicPartition(topic, partition, offset)])

    def poll(self, timeout_s: float) -> Fetched:
        """The next records of the partition, as soon as there are any.

        ``consume(n, timeout)`` waits for ``n`` messages or the timeout: at the end of a
        range that would cost the whole timeout. So it takes what is queued, or waits for
        one message and then takes what is queued.
        """
        messages = self.consumer.consume(READ_BATCH, 0)
        if not messages:
            first = self.consumer.poll(timeout_s)
            if first is None:
                return NOTHING
            messages = [first, *self.consumer.consume(READ_BATCH - 1, 0)]
        good = [m for m in messages if m.error() is None]
        if len(good) < len(messages):
            for m in messages:
                self._error(m.error())
        return Fetched(
            [m.offset() for m in good],  # type: ignore[misc]
            [m.timestamp()[1] for m in good],
            [m.key() for m in good],
            [m.value() for m in good],
            [m.headers() for m in good],  # type: ignore[misc]
        )

    def _error(self, error: Any) -> None:
        """Raise for an error event that will not go away; librdkafka retries the others."""
        if error is None:
            return
        code = error.code()
        where = f"{self.tp.topic}:{self.tp.partition}" if self.tp is not None else "Kafka"
        if code in OUT_OF_RANGE_CODES:
            msg = f"{where}: {error.str()}"
            raise OffsetOutOfRange(msg)
        if error.fatal() or code in DENIED_CODES:
            msg = f"reading {where} failed: {error.name()}: {error.str()}"
            raise ConnectorError(msg)
        LOG.warning("reading %s: %s", where, error.str())

    def position(self) -> int | None:
        """The offset the next read starts at, if known."""
        (tp,) = self.consumer.position([self.tp])
        return int(tp.offset) if tp.offset >= 0 else None

    def release(self) -> None:
        """Stop fetching until the next :meth:`seek` (a shared reader sits idle between tasks)."""
        self.consumer.unassign()

    def close(self) -> None:
        """Release the client."""
        self.consumer.close()


def _translated(exc: KafkaException) -> Exception:
    """A librdkafka error as one of the interface's (or as it is).

    :class:`ProducerFenced`: a fatal error (librdkafka's producer cannot go on: fenced, or
    its epoch lost) or a fencing code; :class:`ProducerBroken`: a transaction to be aborted
    (the sink registers a new producer); :class:`KafkaUnavailable`: an error librdkafka
    calls retriable (a call again goes on: a commit that timed out), a timeout or a lost
    connection.
    """
    error = exc.args[0] if exc.args else None
    if error is None or not hasattr(error, "code"):
        return exc
    text = f"{error.name()}: {error.str()}"
    if error.fatal() or error.code() in FENCED_CODES:
        return ProducerFenced(text)
    if getattr(error, "txn_requires_abort", lambda: False)():
        return ProducerBroken(text)
    if error.retriable() or error.code() in TRANSIENT_CODES:
        return KafkaUnavailable(text)
    return exc


# -- writing ----------------------------------------------------------------------------------


class ConfluentDelivery:
    """:class:`~.interface.Delivery` of one produced record, set by its delivery callback."""

    __slots__ = ("done", "error", "message")

    def __init__(self) -> None:
        self.done = False
        self.error: Any = None
        self.message: Any = None

    def set(self, error: Any, message: Any) -> None:
        """The delivery callback."""
        self.done = True
        self.error = error
        self.message = message

    @property
    def failure(self) -> str | None:
        """Why the record was not written; None when acknowledged or not done."""
        if self.error is None:
            return None
        return f"{self.error.name()}: {self.error.str()}"

    @property
    def poison(self) -> bool:
        """Whether the broker refused the record for good."""
        return self.error is not None and self.error.code() in POISON_CODES

    def where(self) -> tuple[str, int, int]:
        """Topic, partition and offset of the acknowledged record."""
        m = self.message
        return str(m.topic()), int(m.partition()), int(m.offset())


class ConfluentProducer:
    """:class:`~.interface.Producer` over a confluent-kafka ``Producer``."""

    def __init__(self, settings: KafkaSettings, options: dict[str, Any]) -> None:
        config = librdkafka_config(settings, options, PRODUCER_NAMES, "KafkaSink")
        config.update({"error_cb": self._on_error, "logger": LOG})
        self.fatal: str | None = None
        self.producer = LibProducer(config)

    def _on_error(self, error: Any) -> None:
        if error.fatal():
            self.fatal = f"{error.name()}: {error.str()}"
        else:
            LOG.warning("Kafka producer: %s", error.str())

    def send(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Headers | None,
        timestamp_ms: int | None,
    ) -> Delivery:
        """Queue a record."""
        delivery = ConfluentDelivery()
        wire: Any = headers or None  # (str, bytes) pairs, as confluent-kafka takes them
        deadline = 0.0
        while True:
            try:
                self.producer.produce(
                    topic,
                    value=value,
                    key=key,
                    on_delivery=delivery.set,
                    timestamp=timestamp_ms or 0,
                    headers=wire,
                )
                return delivery
            except BufferError:  # the local queue is full: serve deliveries until there is room
                deadline = deadline or time.monotonic() + QUEUE_FULL_S
                if time.monotonic() > deadline:
                    msg = (
                        f"Kafka took no record for {topic!r} in {QUEUE_FULL_S:.0f} s (the "
                        "producer's queue stayed full)"
                    )
                    raise KafkaUnavailable(msg) from None
                self.producer.poll(0.05)
            except KafkaException as exc:
                error = exc.args[0]
                if error.code() in POISON_CODES:
                    msg = f"{error.name()}: {error.str()}"
                    raise RecordRefused(msg) from None
                raise _translated(exc) from None

    def flush(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until every queued record is acknowledged or failed.

        A producer in a fatal state (fenced) raises :class:`ProducerFenced`: confluent-kafka
        raises its error, or a ``SystemError`` when it served a delivery report after it.
        """
        try:
            self.producer.flush(timeout_s)
        except KafkaException as exc:
            raise _translated(exc) from None
        except SystemError as exc:
            raise ProducerFenced(self.fatal or str(exc)) from None

    def init_transactions(self, timeout_s: float) -> None:
        """Register the transactional id (fences older producers of it)."""
        self._call(self.producer.init_transactions, timeout_s)

    def begin(self) -> None:
        """Begin a transaction."""
        self._call(self.producer.begin_transaction)

    def commit(self, timeout_s: float) -> None:
        """Commit the open transaction (after a timeout, a call again goes on with it)."""
        self._call(self.producer.commit_transaction, timeout_s)

    def abort(self, timeout_s: float) -> None:
        """Abort the open transaction."""
        self._call(self.producer.abort_transaction, timeout_s)

    def _call(self, method: Any, *timeout_s: float) -> None:
        """A transaction method; its error translated (see :func:`_translated`).

        One attempt: a retriable error (a timeout, a coordinator away) is the sink's to retry,
        with a new producer if need be (see ``connectors/kafka/transactional_writer.py``).
        """
        try:
            method(*timeout_s)
        except KafkaException as exc:
            raise _translated(exc) from None

    def close(self, timeout_s: float) -> None:
        """Release the client (at once with ``timeout_s`` 0: what is unsent is dropped).

        A producer dropped at once (it broke while Kafka was away) is not closed: closing
        aborts its transaction first, which would wait for the coordinator. It is destroyed
        with its last reference; its transactional id is registered anew meanwhile.
        """
        if timeout_s <= 0:
            self.producer.purge(True, True, False)
            return
        self.producer.flush(timeout_s)
        close = getattr(self.producer, "close", None)  # confluent-kafka 2.11 and later
        if close is not None:
            close()
