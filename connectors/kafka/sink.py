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

Timestamps: a record is stamped with its event time (``timestamp="event"``, as Flink and
Kafka Streams do), unless the topic would delete it on arrival (its time retention) or refuse
it (its timestamp limits): then it is stamped with the time of writing, and counted as
``restamped``. The topic's settings are read once, when the sink prepares (see
:mod:`.admin`). ``timestamp="write"`` always stamps the time of writing. Either way the event
time travels in the ``onceflow-ts`` header, which a downstream Onceflow source reads first.
The time of writing is the producer's clock when the record is sent: a re-send (a transaction
redone, a task replayed) may carry another one, which changes nothing downstream, since the
``onceflow-id`` header identifies the record and ``onceflow-ts`` holds its event time.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from onceflow.connectors.base import (
    PoisonInTransaction,
    Rejected,
    SinkConnector,
    SinkWriter,
    TaskInfo,
    TransactionalWriter,
)
from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.kafka.admin import TopicRequest, TopicTimes, prepare_topics
from onceflow.connectors.kafka.clients import (
    PYTHON_CLIENT,
    Delivery,
    Producer,
    ProducerFenced,
    RecordRefused,
    check_client,
    new_producer,
    new_reader,
    shared_producer,
)
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
# What a record's Kafka timestamp is: its event time where the topic keeps it, or always the
# time of writing (see the module docstring).
TimestampMode = Literal["event", "write"]
TIMESTAMP_MODES: tuple[TimestampMode, ...] = ("event", "write")
RESTAMPED = "restamped"  # the writer's counter of records stamped with the time of writing


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
    on one Kafka different prefixes). ``options`` go to the producer. ``client`` picks the
    producer's library: ``"python"`` (kafka-python, the default) or ``"confluent"``
    (confluent-kafka, ``pip install 'onceflow[fast]'``; ``options`` may then also use
    librdkafka's dotted names).

    ``timestamp``: ``"event"`` (default) stamps each record with its event time, or with the
    time of writing where the topic would delete or refuse that (see the module docstring);
    ``"write"`` always with the time of writing. ``replication_factor``: of the topics this
    sink creates (its own and the delivery log); default min(3, brokers), with
    ``min.insync.replicas`` min(2, factor) (see :mod:`.admin`).
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
        client: str = PYTHON_CLIENT,
        timestamp: TimestampMode = "event",
        replication_factor: int | None = None,
    ) -> None:
        check_client(client, type(self).__name__)
        if timestamp not in TIMESTAMP_MODES:
            msg = f"{type(self).__name__} timestamp must be 'event' or 'write', got {timestamp!r}"
            raise ConnectorError(msg)
        self.timestamp: TimestampMode = timestamp
        self.replication_factor = replication_factor
        # the topic's timestamp bounds, read by prepare(); none known before
        self.times = TopicTimes()
        self._notes: list[str] = []
        self.client = client
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
        """Fix the connection settings; create the topic, and the delivery log if transactional.

        Reads the topic's timestamp bounds (:attr:`times`, pickled to the workers with the
        sink) and what to say about its replication (:meth:`notes`).
        """
        self.settings  # noqa: B018 - resolved here, on the driver, and pickled to the workers
        topics = [TopicRequest(self.topic, self.partitions, create=self.create_topic)]
        if self.transactional and streaming:
            self.log_topic = f"{pipeline}.{DELIVERY_LOG_SUFFIX}"
            topics.append(TopicRequest(self.log_topic, 1, DELIVERY_LOG_CONFIG))
            if self.transaction_prefix is None:
                self.transaction_prefix = f"onceflow.{pipeline}"
        timed = [self.topic] if self.timestamp == "event" else []
        found = prepare_topics(
            self.settings, topics, self.replication_factor, f"KafkaSink({self.topic!r})", timed
        )
        self.times = found.times.get(self.topic, TopicTimes())
        self._notes = found.notes

    def notes(self) -> list[str]:
        """What :meth:`prepare` found that a person should know (replication, unread settings)."""
        return list(self._notes)

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
                # Registering the id right after the last batch's commit is answered
                # CONCURRENT_TRANSACTIONS until the broker wrote that commit's markers; the
                # client retries after this backoff: 100 ms made each registration ~210 ms
                # (every task, every sink), 10 ms makes it ~30 ms. The same ~1 s of retries.
                retry_backoff_ms=10,
                retries=100,
            )
        return config

    def record(
        self, rec: Record, limit: int
    ) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
        """Key, value and headers (its ID, if any, and event time first) of one record.

        ``limit`` is the most bytes a record may take; this sink leaves a larger one as it is
        (the writer refuses it), the dead-letter sink shortens it.
        """
        key, value, extra = self.encode(rec)
        if not rec.id and not rec.ts:
            return key, value, extra
        first = [(ids.ID_HEADER, rec.id)] if rec.id else []
        # the Kafka timestamp may be the time of writing: the event time always travels here
        first.append((ids.TS_HEADER, ids.ts_header(rec.ts)))
        return key, value, [*first, *extra]

    def timestamp_of(self, rec: Record, now_ms: int) -> int | None:
        """The Kafka timestamp of a record: its event time, or None: the time of writing.

        The time of writing where the topic would delete or refuse the event time (its
        :attr:`times`, as of ``now_ms``), or always with ``timestamp="write"``.
        """
        if self.timestamp == "write" or not rec.ts:
            return None
        return rec.ts if self.times.keeps(rec.ts, now_ms) else None

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
    """Dead letters to a topic: the original payload as the value, the reason in headers.

    Stamped as :class:`KafkaSink` stamps records: a dead letter's event time may be what made
    it one (a wrong clock), and a topic that would delete or refuse it gets the time of
    writing instead; the event time is in the ``onceflow-ts`` header either way.
    """

    def __init__(self, topic: str, **kwargs: Any) -> None:
        super().__init__(topic, codec="json", **kwargs)

    def describe(self) -> str:
        """One line for plans."""
        return f"kafka dead letters {self.topic}"

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
        self.producer: Producer = shared_producer(
            sink.client, sink.settings, {**sink.producer_config(), **sink.user_options}
        )
        self.limit = sink.max_request_size - RECORD_OVERHEAD_BYTES
        self.sent: list[tuple[Record, Delivery]] = []
        self.stamped: set[int] = set()  # records (by id()) in flight with the time of writing
        self.restamped = 0  # ... of which the broker took this many, for good

    def write(self, records: Sequence[Record]) -> list[Rejected]:
        rejected: list[Rejected] = []
        for rec in records:
            try:
                self._send(rec)
            except RecordRefused as exc:
                rejected.append((rec, str(exc)))
            except Exception as exc:
                if not self._stop_sending(exc):
                    raise
                break
        return rejected

    def _send(self, rec: Record) -> None:
        """Encode and queue one record; :class:`RecordRefused` if it can never be written."""
        topic = self.sink.topic
        try:
            key, value, headers = self.sink.record(rec, self.limit)
        except CodecError as exc:
            msg = f"cannot write to Kafka topic {topic!r}: {exc}"
            raise RecordRefused(msg) from exc
        size = _size(key, value, headers)
        if size > self.limit:
            raise RecordRefused(_too_big(topic, size, self.sink.max_request_size))
        stamp = self.sink.timestamp_of(rec, int(time.time() * 1000))
        try:
            delivery = self.producer.send(topic, key, value, headers or None, stamp)
        except RecordRefused as exc:
            msg = f"Kafka topic {topic!r} refused the record: {exc}"
            raise RecordRefused(msg) from exc
        if stamp is None and rec.ts and self.sink.timestamp == "event":
            self.stamped.add(id(rec))
        self.sent.append((rec, delivery))

    def _stop_sending(self, exc: Exception) -> bool:
        """Whether a failed send ends this write quietly (to be settled later); here never."""
        del exc
        return False

    def flush(self) -> list[Rejected]:
        """Return once the broker acknowledged everything written.

        Records the broker refuses for good (too large for it, invalid) come back as
        rejected; any other failure raises, so the task is retried. When the broker refused
        a record batch, the records that failed with it are sent again one at a time: the
        ones it refuses alone are the culprits (see :meth:`_culprits`).
        """
        if not self.sent:
            return []
        self.producer.flush(FLUSH_TIMEOUT_S)
        refused, failed = self._outcomes()
        if not refused:
            self._raise_if_failed(failed)
            return []
        certain, again = _culprits(refused, failed)
        return certain + self._one_at_a_time(again)

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

    def _raise_if_failed(self, failed: list[tuple[Record, str]]) -> None:
        if failed:
            msg = (
                f"Kafka did not accept {len(failed)} record(s) for {self.sink.topic!r}: "
                f"{failed[0][1]}; is the broker up and the topic writable?"
            )
            raise ConnectorError(msg)

    def _one_at_a_time(self, records: list[Record]) -> list[Rejected]:
        """Send each record in a request of its own; return those the broker refuses."""
        rejected: list[Rejected] = []
        for rec in records:
            try:
                self._send(rec)
            except RecordRefused as exc:
                rejected.append((rec, str(exc)))
                continue
            self.producer.flush(FLUSH_TIMEOUT_S)
            refused, failed = self._outcomes()
            self._raise_if_failed(failed)
            rejected += refused
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
            self.producer.flush(FLUSH_TIMEOUT_S)
        finally:
            self.sent = []
            self.stamped = set()


def _culprits(
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


# This worker process's transactional producers, one per transactional id (one per sink):
# registered once, then reused from task to task and across sink partitions.
_TXN_PRODUCERS: dict[str, _Registered] = {}
_PROCESS_TOKEN: tuple[int, str] | None = None


def process_token() -> str:
    """A token naming this worker process (a forked child gets a token of its own)."""
    global _PROCESS_TOKEN  # noqa: PLW0603 - one per process, made when first asked
    pid = os.getpid()
    if _PROCESS_TOKEN is None or _PROCESS_TOKEN[0] != pid:
        _PROCESS_TOKEN = (pid, uuid.uuid4().hex[:12])
    return _PROCESS_TOKEN[1]


@dataclass
class _Registered:
    """A registered transactional producer, and whether a transaction of it is open."""

    producer: Producer
    open: bool = False


def _register(sink: KafkaSink, tid: str) -> _Registered:
    """A new producer of ``tid``, registered with Kafka (kept as this process's for ``tid``).

    Registering fences every older producer of ``tid`` and ends its open transaction.
    """
    _drop(tid)
    producer = new_producer(
        sink.client, sink.settings, {**sink.producer_config(tid), **sink.user_options}
    )
    producer.init_transactions()
    entry = _TXN_PRODUCERS[tid] = _Registered(producer)
    return entry


def _drop(tid: str) -> None:
    """Forget (and close) this process's producer of ``tid``, if any."""
    entry = _TXN_PRODUCERS.pop(tid, None)
    if entry is not None:
        with contextlib.suppress(Exception):
            entry.producer.close(timeout_s=1)


def _fence(sink: KafkaSink, tid: str) -> None:
    """End whatever transaction ``tid`` holds open, wherever its producer runs."""
    _register(sink, tid)
    _drop(tid)


class _TransactionalKafkaWriter(_KafkaWriter, TransactionalWriter):
    """Writes a task's records in Kafka transactions (see the module docstring).

    Its transactional id is this worker process's for the sink (``<prefix>.<sink>.<process
    token>``), registered once and reused by every task of the process; the runtime records it
    in Redis before a transaction begins, and a later attempt of the sink partition settles it
    (:meth:`settle`) when it finds it recorded.
    """

    def __init__(self, sink: KafkaSink, task: TaskInfo) -> None:
        self.sink = sink
        self.task = task
        self.tid = f"{sink.transaction_prefix}.{task.sink}.{process_token()}"
        # the delivery log keeps each sink partition's newest marker (compacted by key)
        self.log_key = f"{sink.transaction_prefix}.{task.sink}.{task.partition}".encode()
        self.limit = sink.max_request_size - RECORD_OVERHEAD_BYTES
        self.sent = []
        self.stamped = set()
        self.restamped = 0
        self.restamping = 0  # acknowledged in the open transaction: final once it commits
        self.entry: _Registered | None = None
        self.prepared = False  # a marker was sent in the transaction now open
        self.clean = True  # the last abort went through
        self.deliveries = 0
        # the first send refused synchronously in this transaction: after a record fails, a
        # transactional producer refuses every later send until the transaction is aborted
        self.failed: Exception | None = None
        # records (by id()) of a batch the broker refused, to send on their own next time
        self.suspects: set[int] = set()

    @property
    def identity(self) -> str:
        """The transactional id: this worker process's for the sink."""
        return self.tid

    @property
    def producer(self) -> Producer:  # type: ignore[override]
        """This process's registered producer of the id (registered when first needed)."""
        if self.entry is None:
            entry = _TXN_PRODUCERS.get(self.tid)
            if entry is None:
                entry = _register(self.sink, self.tid)
            elif entry.open:  # an earlier task of this process left it open: end it first
                self.entry = entry
                self._abort_open()
                entry = self.entry or _register(self.sink, self.tid)
            self.entry = entry
        return self.entry.producer

    def settle(self, identities: Sequence[str]) -> None:
        """End the transactions these ids may hold open (another process's: by fencing it)."""
        for tid in dict.fromkeys(identities):
            if tid != self.tid:
                _fence(self.sink, tid)
                continue
            entry = _TXN_PRODUCERS.get(tid)
            if entry is None:  # this process's producer of it is gone: register anew
                self.entry = _register(self.sink, tid)
            elif entry.open:
                self.entry = entry
                self._abort_open()

    def _stop_sending(self, exc: Exception) -> bool:
        self.failed = exc
        return True

    def _begin(self) -> None:
        producer = self.producer
        assert self.entry is not None
        if self.entry.open:
            return
        try:
            producer.begin()
        except ProducerFenced:
            # another process registered this id since (settling it after a failure of ours)
            self.entry = _register(self.sink, self.tid)
            self.entry.producer.begin()
        self.entry.open = True
        self.prepared = False

    def write(self, records: Sequence[Record]) -> list[Rejected]:
        self._begin()
        if self.failed is not None:
            return []  # settled by prepare(), which aborts, and the transaction is redone
        if not self.suspects:
            return super().write(records)
        rejected = super().write([r for r in records if id(r) not in self.suspects])
        return rejected + self._write_alone([r for r in records if id(r) in self.suspects])

    def _write_alone(self, records: list[Record]) -> list[Rejected]:
        """Send each record in a request of its own, until the broker refuses one.

        The refused one is then the only refusal :meth:`prepare` finds: certainly poison.
        One the broker took is no longer a suspect: the next transaction sends it with the
        others, so each suspect goes alone once (and each culprit costs one transaction).
        """
        rejected: list[Rejected] = []
        for rec in records:
            if self.failed is not None:
                break
            self.producer.flush(FLUSH_TIMEOUT_S)
            rejected += super().write([rec])
            self.producer.flush(FLUSH_TIMEOUT_S)
            sent = self.sent[-1][1] if self.sent and self.sent[-1][0] is rec else None
            if sent is None or not sent.done:
                continue
            if sent.failure is not None:
                self.failed = ConnectorError(sent.failure)
            else:
                self.suspects.discard(id(rec))
        return rejected

    def prepare(self) -> str:
        """Send the marker, flush, and return ``log topic|partition|offset|delivery id``.

        Records the broker refused abort the transaction (:class:`PoisonInTransaction`): when
        it is not certain which of them are poison, none is named and they are sent on their
        own in the next transaction (:meth:`_write_alone`).
        """
        assert self.sink.log_topic is not None
        self._begin()
        delivery = (
            f"{self.task.batch}.{self.task.partition}.{self.task.attempt_id}.{self.deliveries}"
        )
        self.deliveries += 1
        marker: Delivery | None = None
        if self.failed is None:
            self.prepared = True
            try:
                marker = self.producer.send(
                    self.sink.log_topic, self.log_key, delivery.encode(), None, None
                )
            except Exception as exc:  # noqa: BLE001 - a record failed before: settled below
                self.failed = exc
        self.producer.flush(FLUSH_TIMEOUT_S)
        refused, failed = self._outcomes()
        stopped, self.failed = self.failed, None
        if refused:
            self._abort_and_renew()
            if len(refused) == 1:  # certain (see _culprits); the rest is sent again
                raise PoisonInTransaction(refused)
            self.suspects.update(id(rec) for rec, _ in refused)
            raise PoisonInTransaction([])
        if stopped is not None or failed or marker is None or marker.failure or not marker.done:
            self.abort()
            why = stopped or (failed[0][1] if failed else "the delivery marker was not written")
            msg = f"Kafka refused a send to {self.sink.topic!r} in a transaction: {why}"
            raise ConnectorError(msg)
        self.suspects.clear()
        topic, partition, offset = marker.where()
        return f"{topic}|{partition}|{offset}|{delivery}"

    def _abort_and_renew(self) -> None:
        """Abort, then register the id afresh.

        After the broker refused a record, neither client's producer is fit for the next
        transaction (measured: kafka-python's is left in the middle of an epoch bump,
        librdkafka's sequence numbers skip and its next commit fails). The transaction was
        aborted with its marker unsent or refused: nothing of it can become visible.
        """
        self.abort()
        self.entry = _register(self.sink, self.tid)
        self.prepared = False

    def _written_restamped(self, n: int) -> None:
        self.restamping += n

    def commit(self) -> None:
        assert self.entry is not None
        self.entry.producer.commit()
        self.entry.open = False
        self.prepared = False
        self.restamped += self.restamping
        self.restamping = 0

    def committed(self, marker: str) -> bool:
        """Read the marker (call once every id recorded for the partition is settled)."""
        return marker_committed(self.sink.settings, marker, self.sink.client)

    def flush(self) -> list[Rejected]:
        """Transactional records are settled by :meth:`prepare`; nothing to do here."""
        return []

    def close(self) -> None:
        self.abort()

    def abort(self) -> None:
        self.sent = []
        self.stamped = set()
        self.restamping = 0
        self.failed = None
        if self.entry is not None and self.entry.open:
            self._abort_open()

    def _abort_open(self) -> None:
        """Abort the open transaction; a producer that cannot is dropped (registered anew)."""
        assert self.entry is not None
        try:
            self.entry.producer.abort()
            self.entry.open = False
            self.clean = True
        except Exception:  # noqa: BLE001 - a fenced or broken producer: start afresh next time
            _drop(self.tid)
            self.entry = None
            self.clean = False

    def aborted_cleanly(self) -> bool:
        """Whether the abort went through before any marker was sent (see the base class)."""
        return self.clean and not self.prepared


def marker_committed(settings: KafkaSettings, marker: str, client: str = PYTHON_CLIENT) -> bool:
    """Whether the delivery marker ``topic|partition|offset|delivery`` was committed.

    A ``read_committed`` reader at the marker's offset gets the marker if its transaction
    committed, and skips past it if it was aborted. Call only once the transaction is over
    (a producer of the same transactional id was registered since).
    """
    topic, partition, offset_text, delivery = marker.split("|", 3)
    offset = int(offset_text)
    reader = new_reader(client, settings)
    try:
        reader.seek(topic, int(partition), offset)
        deadline = time.monotonic() + MARKER_WAIT_S
        while time.monotonic() < deadline:
            fetched = reader.poll(0.5)
            at = bisect.bisect_left(fetched.offsets, offset)
            if at < len(fetched):
                return fetched.offsets[at] == offset and fetched.values[at] == delivery.encode()
            position = reader.position()
            if position is not None and position > offset:
                return False
    finally:
        reader.close()
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
