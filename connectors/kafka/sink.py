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

A broker that goes away under a write is waited for (:mod:`.outage`): a plain writer sends
again what Kafka did not take, a transactional one has its broken transaction ended and, if
it did not commit, redone (see :class:`_TransactionalKafkaWriter`).
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import time
from collections import OrderedDict
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
    TransactionBroken,
    renamed,
)
from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.kafka.admin import TopicRequest, TopicTimes, prepare_topics
from onceflow.connectors.kafka.clients import (
    PYTHON_CLIENT,
    Delivery,
    KafkaUnavailable,
    PartitionReader,
    Producer,
    ProducerBroken,
    RecordRefused,
    await_kafka,
    check_client,
    new_producer,
    new_reader,
    renew_shared_producer,
    shared_producer,
)
from onceflow.connectors.kafka.outage import ATTEMPT_S, Wait, describe, retrying, transient
from onceflow.kernel import ids
from onceflow.kernel.codec import value_codec
from onceflow.kernel.errors import CodecError
from onceflow.kernel.records import Record
from onceflow.kernel.settings import KafkaSettings
from onceflow.kernel.windows import Pane

ERROR_HEADER = "onceflow-error"
ORIGIN_HEADER = "onceflow-origin"
STAGE_HEADER = "onceflow-stage"
CODE_HEADER = "onceflow-code"  # the letter's reason in one word (DeadLetter.code)
TRUNCATED_HEADER = "onceflow-truncated"
WINDOW_HEADER = "onceflow-window"  # "start,end" in ms, for window panes
PANE_HEADER = "onceflow-pane"  # "timing,index,final" (on_time,0,1), for window panes
# A producer that answers no record for this long while some wait is replaced (see
# _KafkaWriter._await_answers); it is flushed in slices this long meanwhile.
STUCK_S = 20.0
FLUSH_SLICE_S = 1.0
REGISTER_TIMEOUT_S = ATTEMPT_S  # one attempt at registering a transactional id
COMMIT_TIMEOUT_S = 20.0  # a commit not answered by then is settled by registering anew
ABORT_TIMEOUT_S = 10.0
MAX_ERROR_HEADER = 2000
DEFAULT_MAX_REQUEST_SIZE = 1_048_576  # kafka-python's and the broker's default
DELIVERY_LOG_SUFFIX = "onceflow-deliveries"
# The delivery log only needs each sink partition's newest marker.
DELIVERY_LOG_CONFIG = {"cleanup.policy": "compact"}
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
    try:
        return json.dumps(key, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        msg = f"a Kafka record key must be str, bytes or JSON-able, got {type(key).__name__}"
        raise CodecError(msg) from exc


class KafkaSink(SinkConnector):
    """Writes to a topic, each record carrying its ID; a keyed stream's ``(k, v)`` uses ``k``.

    Only the elements of a keyed stream (after ``key_by`` or a combine per key: the plan says
    so, see :class:`~onceflow.connectors.base.TaskInfo`) are split into record key and value;
    an unkeyed stream's element is the value whatever its type, a tuple included.

    ``transactional`` (default True): in exactly-once runs records become visible to
    ``read_committed`` readers exactly once (see the module docstring); False writes plainly
    (a crash may leave a copy with the same ID). ``transaction_prefix`` names the
    transactional ids (default ``onceflow.<pipeline>``: give two deployments of one pipeline
    on one Kafka different prefixes).

    ``bootstrap_servers`` and ``connection`` (kafka-python's names: ``security_protocol``,
    ``sasl_*``, ``ssl_*`` ...) say where Kafka is and how to log in, for every client the sink
    uses (producers, topic administration, the delivery log's reader), as on ``KafkaSource``;
    they fall back to the ``KAFKA_*`` environment variables. ``producer_options`` go to the
    producers only (``linger_ms``, ``max_request_size``, ``transaction_timeout_ms`` ...),
    over Onceflow's own. ``client`` picks the producer's library: ``"python"`` (kafka-python,
    the default) or ``"confluent"`` (confluent-kafka, ``pip install 'onceflow[fast]'``;
    ``producer_options`` may then also use librdkafka's dotted names). (``options`` is the old
    name of ``producer_options``, deprecated.)

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
        producer_options: dict[str, Any] | None = None,
        client: str = PYTHON_CLIENT,
        timestamp: TimestampMode = "event",
        replication_factor: int | None = None,
        options: dict[str, Any] | None = None,
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
        hint = "connection settings (security_protocol, sasl_*, ssl_*) go in connection="
        producer_options = renamed(
            type(self).__name__, "options", "producer_options", options, producer_options, hint
        )
        self._producer_options = dict(producer_options or {})
        self.codec = value_codec(codec)
        self.key_fn = key
        self.partitions = partitions
        self.create_topic = create_topic
        self.max_request_size = int(
            self._producer_options.get("max_request_size", DEFAULT_MAX_REQUEST_SIZE)
        )

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
        return dict(self._producer_options)

    def describe(self) -> str:
        """One line for plans."""
        return f"kafka {self.topic} ({self.codec.name})"

    def connect(self) -> None:
        """Wait for Kafka to answer: a bounded time, with a progress line, then one line."""
        await_kafka(self.settings)

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

        The user's ``producer_options`` come last, so they can change any of these.
        """
        config: dict[str, Any] = {
            "acks": "all",
            "linger_ms": 5,
            "batch_size": 256 * 1024,
            "retries": 10,
            "max_request_size": self.max_request_size,
            # kafka-python: how long a send (or a registration) may block while Kafka is away
            # before it says so; the sink then waits on (see .outage). librdkafka has none.
            "max_block_ms": int(ATTEMPT_S * 1000),
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
        self, rec: Record, limit: int, keyed: bool = False
    ) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
        """Key, value and headers (its ID, if any, and event time first) of one record.

        ``limit`` is the most bytes a record may take; this sink leaves a larger one as it is
        (the writer refuses it), the dead-letter sink shortens it. ``keyed``: the record is
        an element of a keyed stream, a ``(key, value)`` pair.
        """
        key, value, extra = self.encode(rec, keyed)
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

    def encode(
        self, rec: Record, keyed: bool = False
    ) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
        """Key, value and extra headers of one record (``keyed``: of a keyed stream).

        A window pane ``(key, Pane)`` is written as its value, with the window's bounds and
        the pane's timing, index and finality in the ``onceflow-window`` and
        ``onceflow-pane`` headers (on any stream: a :class:`Pane` is Onceflow's own, never a
        shape of the user's data). Any other pair is split only on a keyed stream.
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
        if pair and keyed:
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

    def encode(
        self, rec: Record, keyed: bool = False
    ) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
        """Raw payload (or the letter as JSON) and headers naming stage, error and origin.

        A letter for an undecodable record keeps its Kafka key as the key, so that the
        record, key and value, can be sent again once the cause is fixed.
        """
        import base64

        letter = rec.elem
        raw = letter.get("raw_b64")
        value = base64.b64decode(raw) if raw is not None else json.dumps(letter).encode()
        raw_key = letter.get("key_b64") if raw is not None else None
        headers = [
            (ERROR_HEADER, str(letter.get("error", ""))[:MAX_ERROR_HEADER].encode()),
            (ORIGIN_HEADER, str(letter.get("origin", "")).encode()),
            (STAGE_HEADER, str(letter.get("stage", "")).encode()),
            (CODE_HEADER, str(letter.get("code", "")).encode()),
        ]
        return (base64.b64decode(raw_key) if raw_key else None), value, headers

    def record(
        self, rec: Record, limit: int, keyed: bool = False
    ) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
        """As :meth:`KafkaSink.record`, but a dead letter too big for the topic is shortened.

        A dead letter is never dropped: its payload is cut to fit and the original size is
        named in the ``onceflow-truncated`` header.
        """
        key, value, headers = super().record(rec, limit, keyed)
        room = limit - _size(key, None, headers) - MAX_ERROR_HEADER
        if value is not None and len(value) > room:
            headers = [*headers, (TRUNCATED_HEADER, str(len(value)).encode())]
            value = value[: max(0, room)]
        return key, value, headers


class _KafkaWriter(SinkWriter):
    """Sends a task's records through the worker's shared producer.

    A Kafka that goes away is waited for (see :mod:`.outage`): a send that cannot be queued
    and a record Kafka did not take (not refused for good) are tried again, with a new
    producer if the old one stopped making progress. A plain sink may so write a second copy
    of a record whose acknowledgement was lost (same ID, same value), as after a crash.
    """

    def __init__(self, sink: KafkaSink, task: TaskInfo) -> None:
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
        except Exception as exc:  # noqa: BLE001 - the sink's key function failed on this record
            msg = f"cannot write to Kafka topic {topic!r}: {type(exc).__name__}: {exc}"
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
        refuses alone are the culprits (see :func:`_culprits`).
        """
        rejected: list[Rejected] = []
        while self.sent:
            refused, failed = self._answers()
            if refused:
                certain, again = _culprits(refused, failed)
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


def transactional_id(prefix: str | None, sink: str, partition: int) -> str:
    """The transactional id of a sink partition's writers: ``<prefix>.<sink>.<partition>``.

    One per (pipeline, sink, stage partition), whichever process writes it: a new attempt
    of the partition registering it fences every older writer of that partition, and only
    of that partition.
    """
    return f"{prefix}.{sink}.{partition}"


# This worker process's transactional producers, by transactional id (one per sink partition
# it wrote): registered once, then reused by that partition's later tasks here. Bounded: the
# least recently used one without an open transaction is closed beyond the limit.
_TXN_PRODUCERS: OrderedDict[str, _Registered] = OrderedDict()
MAX_TXN_PRODUCERS = 64
_TXN_PID = [os.getpid()]  # a forked child starts with none of its parent's producers


@dataclass
class _Registered:
    """A registered transactional producer, and whether a transaction of it is open."""

    producer: Producer
    open: bool = False


def _cached(tid: str) -> _Registered | None:
    """This process's registered producer of ``tid``, if it has one."""
    if _TXN_PID[0] != os.getpid():
        _TXN_PRODUCERS.clear()
        _TXN_PID[0] = os.getpid()
    entry = _TXN_PRODUCERS.get(tid)
    if entry is not None:
        _TXN_PRODUCERS.move_to_end(tid)
    return entry


def _register(sink: KafkaSink, tid: str) -> _Registered:
    """A new producer of ``tid``, registered with Kafka (kept as this process's for ``tid``).

    Registering fences every older producer of ``tid`` and ends its open transaction (a
    commit under way is completed, anything else aborted).
    """
    _drop(tid)
    producer = new_producer(
        sink.client, sink.settings, {**sink.producer_config(tid), **sink.user_options}
    )
    try:
        producer.init_transactions(REGISTER_TIMEOUT_S)
    except BaseException:
        with contextlib.suppress(Exception):
            producer.close(timeout_s=0)
        raise
    _cached(tid)  # the cache belongs to this process
    entry = _TXN_PRODUCERS[tid] = _Registered(producer)
    _evict()
    return entry


def _evict() -> None:
    """Close the least recently used producers beyond :data:`MAX_TXN_PRODUCERS` (none open)."""
    idle = [tid for tid, entry in _TXN_PRODUCERS.items() if not entry.open]
    for tid in idle[: max(0, len(_TXN_PRODUCERS) - MAX_TXN_PRODUCERS)]:
        _drop(tid, timeout_s=1)


def _drop(tid: str, timeout_s: float = 0) -> None:
    """Forget (and close) this process's producer of ``tid``, if any.

    At once by default: a producer dropped because it broke may wait for ever otherwise.
    """
    entry = _TXN_PRODUCERS.pop(tid, None)
    if entry is not None:
        with contextlib.suppress(Exception):
            entry.producer.close(timeout_s=timeout_s)


class _TransactionalKafkaWriter(_KafkaWriter, TransactionalWriter):
    """Writes a task's records in Kafka transactions (see the module docstring).

    Its transactional id is the sink partition's (:func:`transactional_id`); this worker
    process registers it once and its later tasks of the partition reuse the producer. The
    runtime records the id in Redis before a transaction begins, and a later attempt of the
    partition settles it (:meth:`settle`) when it finds it recorded. A producer some other
    registration fenced (the partition's task ran in another process since) is replaced
    without a word: its transaction fails, and the runtime has it :meth:`recover`.

    **A Kafka that goes away** under an open transaction (its producer's sends or commit
    fail, or it stops making progress) ends that producer's use: :meth:`prepare` and
    :meth:`commit` wait (see :mod:`.outage`), then raise :class:`TransactionBroken`; the
    runtime checks in Redis that its attempt still owns the partition and calls
    :meth:`recover`, which registers the id anew (ending the transaction: a commit that
    reached the coordinator completes, anything else is aborted, so nothing of it can still
    change) and reads the prepared marker: committed, the delivery happened; else the
    runtime writes the records again in a new transaction, under a new pending delivery.
    """

    def __init__(self, sink: KafkaSink, task: TaskInfo) -> None:
        self.sink = sink
        self.task = task
        self.keyed = task.keyed
        self.tid = transactional_id(sink.transaction_prefix, task.sink, task.partition)
        # the delivery log keeps each sink partition's newest marker (compacted by key)
        self.log_key = self.tid.encode()
        self.limit = sink.max_request_size - RECORD_OVERHEAD_BYTES
        self.sent = []
        self.stamped = set()
        self.restamped = 0
        self.restamping = 0  # acknowledged in the open transaction: final once it commits
        self.outage = None
        self.entry: _Registered | None = None
        self.prepared = False  # a marker was sent in the transaction now open
        self.marker: str | None = None  # the marker prepare() returned for the open transaction
        self.clean = True  # the last abort went through
        self.deliveries = 0
        # the first send refused synchronously in this transaction: after a record fails, a
        # transactional producer refuses every later send until the transaction is aborted
        self.failed: Exception | None = None
        # records (by id()) of a batch the broker refused, to send on their own next time
        self.suspects: set[int] = set()

    @property
    def identity(self) -> str:
        """The transactional id: the sink partition's."""
        return self.tid

    @property
    def producer(self) -> Producer:  # type: ignore[override]
        """This process's registered producer of the id (registered when first needed)."""
        if self.entry is None:
            entry = _cached(self.tid)
            if entry is None:
                self._renew()
            elif entry.open:  # an earlier task of this process left it open: end it first
                self.entry = entry
                self._abort_open()
                if self.entry is None:
                    self._renew()
            else:
                self.entry = entry
        assert self.entry is not None
        return self.entry.producer

    def _renew(self) -> None:
        """Register the id anew (waiting out Kafka): this process's producer of it is new.

        Ends the id's open transaction wherever its producer runs (see :func:`_register`).
        """
        self.entry = None
        while self.entry is None:
            try:
                self.entry = _register(self.sink, self.tid)
            except Exception as exc:
                if not (transient(exc) or isinstance(exc, ProducerBroken)):
                    raise
                self._waiting().failed(exc)
        self.prepared = False

    def _waiting(self) -> Wait:
        if self.outage is None:
            doing = f"writing to Kafka topic {self.sink.topic!r} in transaction {self.tid!r}"
            self.outage = Wait(self.sink.settings, doing)
        return self.outage

    def settle(self, identities: Sequence[str]) -> None:
        """End the transactions these ids may hold open, by registering each anew.

        The partition's own id included: its last writer may be this process's producer or
        another's. Registering fences only producers of that id, so of this partition.
        """
        for tid in dict.fromkeys(identities):
            if tid == self.tid:
                self._renew()
            else:  # an id of another form (an older Onceflow, another prefix)
                _fence(self.sink, tid)

    def _begin(self) -> None:
        producer = self.producer
        assert self.entry is not None
        if self.entry.open:
            return
        try:
            producer.begin()
        except (ProducerBroken, KafkaUnavailable):
            # another process registered this id since (settling it after a failure of ours)
            self._renew()
            self.producer.begin()
        assert self.entry is not None
        self.entry.open = True
        self.prepared = False
        self.marker = None

    def write(self, records: Sequence[Record]) -> list[Rejected]:
        self._begin()
        if self.failed is not None:
            return []  # prepare() finds the transaction broken, and it is redone
        rejected = self._send_all([r for r in records if id(r) not in self.suspects])
        return rejected + self._write_alone([r for r in records if id(r) in self.suspects])

    def _send_all(self, records: Sequence[Record]) -> list[Rejected]:
        """Queue records until one fails other than for good (then the transaction is broken)."""
        rejected: list[Rejected] = []
        for rec in records:
            if self.failed is not None:
                break
            try:
                self._send(rec)
            except RecordRefused as exc:
                rejected.append((rec, str(exc)))
            except Exception as exc:  # noqa: BLE001 - the transaction cannot commit: prepare() says so
                self.failed = exc
        return rejected

    def _write_alone(self, records: list[Record]) -> list[Rejected]:
        """Send each record in a request of its own, until the broker refuses one.

        The refused one is then the only refusal :meth:`prepare` finds: certainly poison.
        One the broker took is no longer a suspect: the next transaction sends it with the
        others, so each suspect goes alone once (and each culprit costs one transaction).
        """
        rejected: list[Rejected] = []
        for rec in records:
            if self.failed is not None or self._await_answers():
                self.failed = self.failed or KafkaUnavailable("records were not acknowledged")
                break
            rejected += self._send_all([rec])
            if self._await_answers():
                self.failed = KafkaUnavailable("a record sent alone was not acknowledged")
                break
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
        own in the next transaction (:meth:`_write_alone`). A transaction Kafka did not take
        otherwise raises :class:`TransactionBroken` (see the class docstring).
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
        stuck = self._await_answers(*([marker] if marker is not None else []))
        refused, failed = self._outcomes()
        stopped, self.failed = self.failed, None
        if refused and not stuck:
            self._abort_and_renew()
            if len(refused) == 1:  # certain (see _culprits); the rest is sent again
                raise PoisonInTransaction(refused)
            self.suspects.update(id(rec) for rec, _ in refused)
            raise PoisonInTransaction([])
        if stuck or stopped is not None or failed or not _took(marker):
            why = describe(stopped) if stopped is not None else None
            why = why or (failed[0][1] if failed else "the delivery marker was not written")
            msg = f"Kafka did not take the transaction's records: {why}"
            raise self._broken(msg)
        self.suspects.clear()
        assert marker is not None
        topic, partition, offset = marker.where()
        self.marker = f"{topic}|{partition}|{offset}|{delivery}"
        return self.marker

    def _broken(self, why: str) -> TransactionBroken:
        """The open transaction cannot commit: wait a little for Kafka, then say so.

        The producer is not used again: :meth:`recover` registers a new one, whose
        registration ends the transaction; until then it stays recorded for the partition
        (not aborted cleanly), so that an attempt after a crash settles it. Past the outage
        bound this raises :class:`KafkaUnavailable` instead: the run stops.
        """
        self._discard()
        self.clean = False
        self._waiting().failed(KafkaUnavailable(why))
        return TransactionBroken(why)

    def _discard(self) -> None:
        """Stop using this writer's producer: close it, and forget it if it is the process's."""
        entry, self.entry = self.entry, None
        if entry is None:
            return
        if _TXN_PRODUCERS.get(self.tid) is entry:
            del _TXN_PRODUCERS[self.tid]
        with contextlib.suppress(Exception):
            entry.producer.close(timeout_s=0)

    def _abort_and_renew(self) -> None:
        """Abort, then register the id afresh.

        After the broker refused a record, neither client's producer is fit for the next
        transaction (measured: kafka-python's is left in the middle of an epoch bump,
        librdkafka's sequence numbers skip and its next commit fails). The transaction was
        aborted with its marker unsent or refused: nothing of it can become visible.
        """
        self.abort()
        self._renew()

    def _written_restamped(self, n: int) -> None:
        self.restamping += n

    def commit(self) -> None:
        """Commit; a commit Kafka does not answer within :data:`COMMIT_TIMEOUT_S` is broken.

        The wait says so every 10 s (see :mod:`.outage`); a broken commit's fate is learnt
        by :meth:`recover`.
        """
        assert self.entry is not None
        deadline = time.monotonic() + COMMIT_TIMEOUT_S
        while True:
            try:
                self.entry.producer.commit(FLUSH_SLICE_S)
                break
            except KafkaUnavailable as exc:
                if time.monotonic() < deadline:
                    self._waiting().note(f"the commit is not answered yet: {describe(exc)}")
                    continue
                msg = f"the commit was not answered: {describe(exc)}"
                raise self._broken(msg) from exc
            except ProducerBroken as exc:
                msg = f"the commit failed: {describe(exc)}"
                raise self._broken(msg) from exc
        self.entry.open = False
        self.prepared = False
        self.restamped += self.restamping
        self.restamping = 0
        self.clean = True
        self.outage = None  # Kafka answered: a later outage is waited for from its start

    def recover(self) -> bool:
        """End the broken transaction (registering the id anew); whether its marker committed.

        Waits for Kafka as long as the outage bound allows, registering and then reading the
        marker :meth:`prepare` returned, if it returned one. Records stamped with the time of
        writing in it count as restamped only if it committed.
        """
        marker, self.marker = self.marker, None
        self._discard()
        self._renew()
        done = marker is not None and self.committed(marker)
        if done:
            self.restamped += self.restamping
        self.restamping = 0
        return done

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
            self.entry.producer.abort(ABORT_TIMEOUT_S)
            self.entry.open = False
            self.clean = True
        except Exception:  # noqa: BLE001 - a fenced or broken producer: start afresh next time
            self._discard()
            self.clean = False

    def aborted_cleanly(self) -> bool:
        """Whether the abort went through before any marker was sent (see the base class)."""
        return self.clean and not self.prepared


def _took(marker: Delivery | None) -> bool:
    """Whether the broker acknowledged the delivery marker."""
    return marker is not None and marker.done and marker.failure is None


def _fence(sink: KafkaSink, tid: str) -> None:
    """End whatever transaction ``tid`` holds open, wherever its producer runs."""
    retrying(
        sink.settings,
        f"registering transactional id {tid!r}",
        lambda: _register(sink, tid),
        is_transient=lambda exc: transient(exc) or isinstance(exc, ProducerBroken),
    )
    _drop(tid)


def marker_committed(settings: KafkaSettings, marker: str, client: str = PYTHON_CLIENT) -> bool:
    """Whether the delivery marker ``topic|partition|offset|delivery`` was committed.

    A ``read_committed`` reader at the marker's offset gets the marker if its transaction
    committed, and skips past it if it was aborted. Call only once the transaction is over
    (a producer of the same transactional id was registered since). Kafka away is waited
    for, within the outage bound (see :mod:`.outage`).
    """
    topic, partition, offset_text, delivery = marker.split("|", 3)
    offset = int(offset_text)
    wait = Wait(settings, f"reading the delivery marker at {topic}:{partition}@{offset}")
    reader: PartitionReader | None = None
    try:
        while True:
            try:
                if reader is None:
                    reader = new_reader(client, settings)
                    reader.seek(topic, int(partition), offset)
                found = _marker_found(reader, offset, delivery)
            except Exception as exc:
                if not transient(exc):
                    raise
                if reader is not None:
                    with contextlib.suppress(Exception):
                        reader.close()
                reader = None
                wait.failed(exc)
                continue
            if found is not None:
                return found
            wait.note("no answer to a read of the marker yet")
    finally:
        if reader is not None:
            reader.close()


def _marker_found(reader: PartitionReader, offset: int, delivery: str) -> bool | None:
    """One poll at the marker: committed (True), aborted (False) or not known yet (None)."""
    fetched = reader.poll(0.5)
    at = bisect.bisect_left(fetched.offsets, offset)
    if at < len(fetched):
        return fetched.offsets[at] == offset and fetched.values[at] == delivery.encode()
    position = reader.position()
    if position is not None and position > offset:
        return False
    return None


def _size(key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]]) -> int:
    return len(key or b"") + len(value or b"") + sum(len(k) + len(v) for k, v in headers)


def _too_big(topic: str, size: int, limit: int) -> str:
    return (
        f"the record is {size:,} bytes, more than the producer's max_request_size {limit:,} for "
        f"Kafka topic {topic!r}; shrink the record or raise max_request_size (and the topic's "
        "max.message.bytes)"
    )
