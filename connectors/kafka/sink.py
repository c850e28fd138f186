"""The Kafka sink: each record written with its ID in the ``onceflow-id`` header.

Its event time goes in ``onceflow-ts``, so an Onceflow pipeline reading the topic stays
exactly-once end to end. Dead letters go to a topic of their own, with the original payload
as the value and the reason, origin and stage in headers.

In exactly-once runs the sink writes transactionally by default: each sink partition's
records go out in Kafka transactions (transactional id ``<prefix>.<sink>.<partition>``, so a
restarted or zombie attempt fences the older producer), each with a marker record in the
pipeline's delivery log topic (``<pipeline>.onceflow-deliveries``); the runtime records the
delivery as pending in Redis with the marker's offset before committing, and marks the
records delivered after. A crash anywhere in between is resolved by the next attempt from
the marker: a ``read_committed`` reader sees every record exactly once. With
``transactional=False`` records are visible when acknowledged; a crash between the write
and the delivered-mark can leave a copy (same ID, same value), counted by ``onceflow
status`` as a possible copy and by ``onceflow audit`` in the topic.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from onceflow.connectors.base import (
    PoisonInTransaction,
    Rejected,
    SinkConnector,
    SinkWriter,
    TaskInfo,
    TransactionalWriter,
)
from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.kafka.clients import ensure_topics, shared_client
from onceflow.kernel import ids
from onceflow.kernel.codec import value_codec
from onceflow.kernel.errors import CodecError
from onceflow.kernel.records import Record
from onceflow.kernel.settings import KafkaSettings
from onceflow.kernel.windows import Pane

ERROR_HEADER = "onceflow-error"
ORIGIN_HEADER = "onceflow-origin"
STAGE_HEADER = "onceflow-stage"
TRUNCATED_HEADER = "onceflow-truncated"
WINDOW_HEADER = "onceflow-window"  # "start,end" in ms, for window panes
PANE_HEADER = "onceflow-pane"  # "timing,index,final" (on_time,0,1), for window panes
FLUSH_TIMEOUT_S = 120
MAX_ERROR_HEADER = 2000
DEFAULT_MAX_REQUEST_SIZE = 1_048_576  # kafka-python's and the broker's default
DELIVERY_LOG_SUFFIX = "onceflow-deliveries"
# The delivery log only needs each sink partition's newest marker.
DELIVERY_LOG_CONFIG = {"cleanup.policy": "compact"}
MARKER_WAIT_S = 60  # how long a recovering task waits to learn a marker's fate
# Record batch framing and per-record headers Kafka adds around key, value and headers.
RECORD_OVERHEAD_BYTES = 512
# Errors after which the same record would be refused again: dead-letter it, do not retry.
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


def _key_bytes(key: Any) -> bytes | None:
    if key is None or isinstance(key, bytes):
        return key
    if isinstance(key, str):
        return key.encode()
    return json.dumps(key, separators=(",", ":")).encode()


class KafkaSink(SinkConnector):
    """Writes to a topic, each record carrying its ID; keyed elements ``(k, v)`` use ``k``.

    ``transactional`` (default True): in exactly-once runs records become visible to
    ``read_committed`` readers exactly once (see the module docstring); False writes plainly
    (a crash may leave a copy with the same ID). ``transaction_prefix`` names the
    transactional ids (default ``onceflow.<pipeline>``: give two deployments of one pipeline
    on one Kafka different prefixes). ``options`` go to the producer.
    """

    def __init__(
        self,
        topic: str,
        *,
        bootstrap_servers: str | None = None,
        codec: str = "json",
        key: Callable[[Any], Any] | None = None,
        partitions: int = 2,
        create_topic: bool = True,
        transactional: bool = True,
        transaction_prefix: str | None = None,
        connection: dict[str, Any] | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.transactional = transactional
        self.transaction_prefix = transaction_prefix
        self.log_topic: str | None = None
        self.topic = topic
        self._bootstrap = bootstrap_servers
        self._connection = dict(connection or {})
        self._resolved: KafkaSettings | None = None
        self._options = dict(options or {})
        self.codec = value_codec(codec)
        self.key_fn = key
        self.partitions = partitions
        self.create_topic = create_topic
        self.max_request_size = int(self._options.get("max_request_size", DEFAULT_MAX_REQUEST_SIZE))

    @property
    def settings(self) -> KafkaSettings:
        """Connection settings (arguments first, then the environment), fixed once read.

        They are read on the driver (:meth:`prepare` does) and travel to the workers inside
        the pickled sink: a worker never looks at its own environment, which on a cluster
        holds none of the driver's ``KAFKA_*`` variables.
        """
        if self._resolved is None:
            self._resolved = KafkaSettings.from_env(self._bootstrap, **self._connection)
        return self._resolved

    @property
    def user_options(self) -> dict[str, Any]:
        """The producer options the user gave (they override Onceflow's)."""
        return dict(self._options)

    def describe(self) -> str:
        """One line for plans."""
        return f"kafka {self.topic} ({self.codec.name})"

    def prepare(self, pipeline: str, streaming: bool) -> None:
        """Fix the connection settings; create the topic, and the delivery log if transactional."""
        self.settings  # noqa: B018 - resolved here, on the driver, and pickled to the workers
        if self.create_topic:
            ensure_topics(self.settings, [self.topic], self.partitions)
        if self.transactional and streaming:
            self.log_topic = f"{pipeline}.{DELIVERY_LOG_SUFFIX}"
            ensure_topics(self.settings, [self.log_topic], 1, DELIVERY_LOG_CONFIG)
            if self.transaction_prefix is None:
                self.transaction_prefix = f"onceflow.{pipeline}"

    def open(self, task: TaskInfo) -> SinkWriter:
        """A transactional writer in exactly-once runs, else one sharing the worker's producer."""
        if self.transactional and task.exactly_once and self.log_topic is not None:
            return _TransactionalKafkaWriter(self, task)
        return _KafkaWriter(self, task)

    def producer_config(self, transactional_id: str | None = None) -> dict[str, Any]:
        """Settings of a producer of this sink (shared in a worker, or one per transaction id).

        The user's ``options`` come last, so they can change any of these.
        """
        config: dict[str, Any] = {
            "acks": "all",
            "linger_ms": 5,
            "batch_size": 256 * 1024,
            "retries": 10,
            "max_request_size": self.max_request_size,
        }
        if transactional_id is None:
            # Dedup is by onceflow-id; the broker's idempotent producer is not relied on.
            config.update(enable_idempotence=False, max_in_flight_requests_per_connection=1)
        else:
            config.update(
                enable_idempotence=True,
                transactional_id=transactional_id,
                max_in_flight_requests_per_connection=5,
            )
        return config

    def record(
        self, rec: Record, limit: int
    ) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
        """Key, value and headers (its ID and event time first) of one record.

        ``limit`` is the most bytes a record may take; this sink leaves a larger one as it is
        (the writer refuses it), the dead-letter sink shortens it.
        """
        key, value, extra = self.encode(rec)
        if not rec.id:
            return key, value, extra
        return key, value, [(ids.ID_HEADER, rec.id), (ids.TS_HEADER, ids.ts_header(rec.ts)), *extra]

    def timestamp_of(self, rec: Record) -> int | None:
        """The Kafka timestamp of a record: its event time (None: the time of writing)."""
        return rec.ts or None

    def encode(self, rec: Record) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
        """Key, value and extra headers of one record.

        A window pane ``(key, Pane)`` is written as its value, with the window's bounds and
        the pane's timing, index and finality in the ``onceflow-window`` and
        ``onceflow-pane`` headers.
        """
        elem = rec.elem
        pair = isinstance(elem, tuple) and len(elem) == 2
        if pair and isinstance(elem[1], Pane):
            pane = elem[1]
            key = self.key_fn(elem) if self.key_fn is not None else elem[0]
            headers = [(WINDOW_HEADER, pane.window_header()), (PANE_HEADER, pane.pane_header())]
            return _key_bytes(key), self.codec.encode(pane.value), headers
        if self.key_fn is not None:
            return _key_bytes(self.key_fn(elem)), self.codec.encode(elem), []
        if pair:
            return _key_bytes(elem[0]), self.codec.encode(elem[1]), []
        return None, self.codec.encode(elem), []


class KafkaDeadLetterSink(KafkaSink):
    """Dead letters to a topic: the original payload as the value, the reason in headers."""

    def __init__(self, topic: str, **kwargs: Any) -> None:
        super().__init__(topic, codec="json", **kwargs)

    def describe(self) -> str:
        """One line for plans."""
        return f"kafka dead letters {self.topic}"

    def timestamp_of(self, rec: Record) -> int | None:
        """The time of writing, not the event time (in the ``onceflow-ts`` header).

        A dead letter's event time may be what made it one: a wrong clock the broker refuses.
        """
        del rec
        return None

    def encode(self, rec: Record) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
        """Raw payload (or the letter as JSON) and headers naming stage, error and origin."""
        import base64

        letter = rec.elem
        raw = letter.get("raw_b64")
        value = base64.b64decode(raw) if raw is not None else json.dumps(letter).encode()
        headers = [
            (ERROR_HEADER, str(letter.get("error", ""))[:MAX_ERROR_HEADER].encode()),
            (ORIGIN_HEADER, str(letter.get("origin", "")).encode()),
            (STAGE_HEADER, str(letter.get("stage", "")).encode()),
        ]
        return None, value, headers

    def record(
        self, rec: Record, limit: int
    ) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
        """As :meth:`KafkaSink.record`, but a dead letter too big for the topic is shortened.

        A dead letter is never dropped: its payload is cut to fit and the original size is
        named in the ``onceflow-truncated`` header.
        """
        key, value, headers = super().record(rec, limit)
        room = limit - _size(key, None, headers) - MAX_ERROR_HEADER
        if value is not None and len(value) > room:
            headers = [*headers, (TRUNCATED_HEADER, str(len(value)).encode())]
            value = value[: max(0, room)]
        return key, value, headers


class _KafkaWriter(SinkWriter):
    """Sends a task's records through the worker's shared producer."""

    def __init__(self, sink: KafkaSink, task: TaskInfo) -> None:
        self.sink = sink
        self.producer: Any = shared_client(
            "producer", sink.settings, **{**sink.producer_config(), **sink.user_options}
        )
        self.limit = sink.max_request_size - RECORD_OVERHEAD_BYTES
        self.sent: list[tuple[Record, Any]] = []

    def write(self, records: Sequence[Record]) -> list[Rejected]:
        from kafka.errors import MessageSizeTooLargeError

        send = self.producer.send
        topic = self.sink.topic
        rejected: list[Rejected] = []
        for rec in records:
            try:
                key, value, headers = self.sink.record(rec, self.limit)
            except CodecError as exc:
                rejected.append((rec, f"cannot write to Kafka topic {topic!r}: {exc}"))
                continue
            size = _size(key, value, headers)
            if size > self.limit:
                rejected.append((rec, _too_big(topic, size, self.sink.max_request_size)))
                continue
            try:
                future = send(
                    topic,
                    value=value,
                    key=key,
                    headers=headers or None,
                    timestamp_ms=self.sink.timestamp_of(rec),
                )
            except MessageSizeTooLargeError as exc:
                rejected.append((rec, f"Kafka topic {topic!r} refused the record: {exc}"))
                continue
            except Exception as exc:
                if not self._stop_sending(exc):
                    raise
                break
            self.sent.append((rec, future))
        return rejected

    def _stop_sending(self, exc: Exception) -> bool:
        """Whether a failed send ends this write quietly (to be settled later); here never."""
        del exc
        return False

    def flush(self) -> list[Rejected]:
        """Return once the broker acknowledged everything written.

        Records the broker refuses for good (too large for it, invalid) come back as
        rejected; any other failure raises, so the task is retried.
        """
        if not self.sent:
            return []
        self.producer.flush(timeout=FLUSH_TIMEOUT_S)
        return self._settle()

    def _settle(self, lenient: bool = False) -> list[Rejected]:
        """Sort flushed sends into acknowledged and refused; raise on any other failure.

        ``lenient`` (a transaction about to be aborted and redone): when some records were
        refused, other failures (sends the broker aborted with them) do not raise.
        """
        sent, self.sent = self.sent, []
        rejected: list[Rejected] = []
        failed: list[Any] = []
        for rec, future in sent:
            if future.is_done and not future.failed():
                continue
            error = future.exception if future.is_done else None
            if error is not None and type(error).__name__ in POISON_ERRORS:
                rejected.append(
                    (rec, f"Kafka topic {self.sink.topic!r} refused the record: {error}")
                )
            else:
                failed.append(error or "no acknowledgement")
        if failed and not (lenient and rejected):
            msg = (
                f"Kafka did not accept {len(failed)} record(s) for {self.sink.topic!r}: "
                f"{failed[0]}; is the broker up and the topic writable?"
            )
            raise ConnectorError(msg)
        return rejected

    def close(self) -> None:
        leftover = self.flush()
        if leftover:
            first = leftover[0][1]
            msg = f"{len(leftover)} record(s) refused by {self.sink.topic!r} at close: {first}"
            raise ConnectorError(msg)

    def abort(self) -> None:
        """Wait for what is in flight (so nothing of this attempt lands after it ended)."""
        try:
            self.producer.flush(timeout=FLUSH_TIMEOUT_S)
        finally:
            self.sent = []


# Transactional producers, one per transactional id, kept for the life of the worker process.
_TXN_PRODUCERS: dict[str, Any] = {}
_FENCED = frozenset({"ProducerFencedError", "InvalidProducerEpochError", "IllegalStateError"})


def _txn_producer(sink: KafkaSink, tid: str, fresh: bool = False) -> Any:
    """The worker's producer for a transactional id.

    ``fresh`` registers it again with Kafka, which fences every older producer of that id and
    ends its open transaction.
    """
    producer = _TXN_PRODUCERS.pop(tid, None)
    if producer is not None and not fresh:
        _TXN_PRODUCERS[tid] = producer
        return producer
    if producer is not None:
        with contextlib.suppress(Exception):
            producer.close(timeout=1)
    from kafka import KafkaProducer

    config = {**sink.settings.client_config(), **sink.producer_config(tid), **sink.user_options}
    producer = KafkaProducer(**config)
    producer.init_transactions()
    _TXN_PRODUCERS[tid] = producer
    return producer


class _TransactionalKafkaWriter(_KafkaWriter, TransactionalWriter):
    """Writes a task's records in Kafka transactions (see the module docstring)."""

    def __init__(self, sink: KafkaSink, task: TaskInfo) -> None:
        self.sink = sink
        self.task = task
        self.tid = f"{sink.transaction_prefix}.{task.sink}.{task.partition}"
        # Registered afresh for every task: this fences any older producer of the id (a
        # zombie attempt, or this process's own from an earlier batch) and ends its open
        # transaction, so the task starts from a settled state.
        self.producer = _txn_producer(sink, self.tid, fresh=True)
        self.limit = sink.max_request_size - RECORD_OVERHEAD_BYTES
        self.sent = []
        self.open_txn = False
        self.deliveries = 0
        # the first send refused synchronously in this transaction: after a record fails, a
        # transactional producer refuses every later send until the transaction is aborted
        self.failed: Exception | None = None

    def _stop_sending(self, exc: Exception) -> bool:
        self.failed = exc
        return True

    def _begin(self) -> None:
        if self.open_txn:
            return
        try:
            self.producer.begin_transaction()
        except Exception as exc:
            if type(exc).__name__ not in _FENCED:
                raise
            # another process re-registered this id since (an older task's producer, left
            # behind when its task moved): register again; this task owns the partition
            self.producer = _txn_producer(self.sink, self.tid, fresh=True)
            self.producer.begin_transaction()
        self.open_txn = True

    def write(self, records: Sequence[Record]) -> list[Rejected]:
        self._begin()
        if self.failed is not None:
            return []  # settled by prepare(), which aborts, and the transaction is redone
        return super().write(records)

    def prepare(self) -> str:
        """Send the marker, flush, and return ``log topic|partition|offset|delivery id``."""
        assert self.sink.log_topic is not None
        self._begin()
        delivery = (
            f"{self.task.batch}.{self.task.partition}.{self.task.attempt_id}.{self.deliveries}"
        )
        self.deliveries += 1
        marker = None
        if self.failed is None:
            try:
                marker = self.producer.send(
                    self.sink.log_topic, key=self.tid.encode(), value=delivery.encode()
                )
            except Exception as exc:  # noqa: BLE001 - a record failed before: settled below
                self.failed = exc
        self.producer.flush(timeout=FLUSH_TIMEOUT_S)
        rejected = self._settle(lenient=True)
        failed, self.failed = self.failed, None
        if rejected:
            self.abort()
            raise PoisonInTransaction(rejected)
        if failed is not None or marker is None:
            self.abort()
            msg = f"Kafka refused a send to {self.sink.topic!r} in a transaction: {failed}"
            raise ConnectorError(msg)
        meta = marker.get(timeout=FLUSH_TIMEOUT_S)
        return f"{meta.topic}|{meta.partition}|{meta.offset}|{delivery}"

    def commit(self) -> None:
        self.producer.commit_transaction()
        self.open_txn = False

    def committed(self, marker: str) -> bool:
        """Read the marker (older producers of this id were fenced when this writer opened)."""
        return marker_committed(self.sink.settings, marker)

    def flush(self) -> list[Rejected]:
        """Transactional records are settled by :meth:`prepare`; nothing to do here."""
        return []

    def close(self) -> None:
        self.abort()

    def abort(self) -> None:
        if self.open_txn:
            self.sent = []
            self.failed = None
            try:
                self.producer.abort_transaction()
            except Exception:  # noqa: BLE001 - a fenced or broken producer: start afresh
                self.producer = _txn_producer(self.sink, self.tid, fresh=True)
            self.open_txn = False


def marker_committed(settings: KafkaSettings, marker: str) -> bool:
    """Whether the delivery marker ``topic|partition|offset|delivery`` was committed.

    A ``read_committed`` reader at the marker's offset gets the marker if its transaction
    committed, and skips past it if it was aborted. Call only once the transaction is over
    (a producer of the same transactional id was registered since).
    """
    from kafka import KafkaConsumer, TopicPartition

    topic, partition, offset_text, delivery = marker.split("|", 3)
    offset = int(offset_text)
    tp = TopicPartition(topic, int(partition))
    consumer = KafkaConsumer(
        **settings.client_config(),
        isolation_level="read_committed",
        enable_auto_commit=False,
        group_id=None,
    )
    try:
        consumer.assign([tp])
        consumer.seek(tp, offset)
        deadline = time.monotonic() + MARKER_WAIT_S
        while time.monotonic() < deadline:
            for rec in consumer.poll(timeout_ms=500).get(tp, []):
                if rec.offset == offset:
                    return bool(rec.value == delivery.encode())
                if rec.offset > offset:
                    return False
            if consumer.position(tp) > offset:
                return False
    finally:
        consumer.close()
    msg = (
        f"could not learn within {MARKER_WAIT_S} s whether Kafka committed the delivery "
        f"marked at {topic}:{partition}@{offset}; is the broker up?"
    )
    raise ConnectorError(msg)


def _size(key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]]) -> int:
    return len(key or b"") + len(value or b"") + sum(len(k) + len(v) for k, v in headers)


def _too_big(topic: str, size: int, limit: int) -> str:
    return (
        f"the record is {size:,} bytes, more than the producer's max_request_size {limit:,} for "
        f"Kafka topic {topic!r}; shrink the record or raise max_request_size (and the topic's "
        "max.message.bytes)"
    )
