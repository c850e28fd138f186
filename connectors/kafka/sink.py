"""The Kafka sink: each record written with its ID in the ``onceflow-id`` header.

Its event time goes in ``onceflow-ts``, so an Onceflow pipeline reading the topic stays
exactly-once end to end. Dead letters go to a topic of their own, with the original payload
as the value and the reason, origin and stage in headers (:mod:`.dead_letters`).

In exactly-once runs the sink writes transactionally by default: each sink partition's
records go out in Kafka transactions (transactional id ``<prefix>.<sink>.<partition>.<lease>``,
``lease`` being the worker process's lease number on its machine, see :mod:`.leases`; a restarted
attempt registers anew every id an earlier attempt of the partition recorded in Redis, which
fences its producers), each with a marker record in the
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
it did not commit, redone (see :class:`~.transactional_writer.TransactionalKafkaWriter`).

This module declares the sink; the parts it is made of live beside it: :mod:`.serialization`
(header names, keys, sizes), :mod:`.writer` (the plain writer), :mod:`.transactional_writer`
(the commit protocol), :mod:`.transactional_producers` (registering and fencing transactional
ids) and :mod:`.delivery_log` (the markers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from onceflow.connectors.base import SinkConnector, SinkWriter, TaskInfo, renamed
from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.kafka.admin import TopicRequest, TopicTimes, prepare_topics
from onceflow.connectors.kafka.clients import (
    AUTO_CLIENT,
    await_kafka,
    check_client,
    resolve_client,
)
from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.delivery_log import DELIVERY_LOG_CONFIG, DELIVERY_LOG_SUFFIX
from onceflow.connectors.kafka.outage import ATTEMPT_S
from onceflow.connectors.kafka.serialization import (
    CODE_HEADER,
    ERROR_HEADER,
    ORIGIN_HEADER,
    PANE_HEADER,
    STAGE_HEADER,
    TRUNCATED_HEADER,
    WINDOW_HEADER,
    key_bytes,
)
from onceflow.connectors.kafka.transactional_writer import TransactionalKafkaWriter
from onceflow.connectors.kafka.writer import KafkaWriter
from onceflow.connectors.registry import RegistryCodec, bind_codec
from onceflow.kernel import ids
from onceflow.kernel.codec import ValueCodec
from onceflow.kernel.records import Record
from onceflow.kernel.windows import Pane

__all__ = [
    "CODE_HEADER",
    "ERROR_HEADER",
    "ORIGIN_HEADER",
    "PANE_HEADER",
    "STAGE_HEADER",
    "TIMESTAMP_MODES",
    "TRUNCATED_HEADER",
    "WINDOW_HEADER",
    "KafkaSink",
    "TimestampMode",
]

DEFAULT_MAX_REQUEST_SIZE = 1_048_576  # kafka-python's and the broker's default
# What a record's Kafka timestamp is: its event time where the topic keeps it, or always the
# time of writing (see the module docstring).
TimestampMode = Literal["event", "write"]
TIMESTAMP_MODES: tuple[TimestampMode, ...] = ("event", "write")


class KafkaSink(SinkConnector):
    """Writes to a topic, each record carrying its ID; a keyed stream's ``(k, v)`` uses ``k``.

    Only the elements of a keyed stream (after ``key_by`` or a combine per key: the plan says
    so, see :class:`~onceflow.connectors.base.TaskInfo`) are split into record key and value;
    an unkeyed stream's element is the value whatever its type, a tuple included. On a keyed
    stream ``(k, None)`` is a tombstone (a record with no value: a compacted topic then drops
    ``k``), as Kafka's own tools read it.

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
        codec: str | ValueCodec | RegistryCodec = "json",
        key: Callable[[Any], Any] | None = None,
        partitions: int = 2,
        create_topic: bool = True,
        transactional: bool = True,
        transaction_prefix: str | None = None,
        connection: dict[str, Any] | None = None,
        producer_options: dict[str, Any] | None = None,
        client: str = AUTO_CLIENT,
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
        self.client = resolve_client(client)
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
        self.codec = bind_codec(codec, topic)
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
        if self.codec.prepare is not None:  # a registry codec: its schema id, for the workers
            self.codec.prepare()
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
            return TransactionalKafkaWriter(self, task)
        return KafkaWriter(self, task)

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
            return key_bytes(key), self.codec.encode(pane.value), headers
        if self.key_fn is not None:
            return key_bytes(self.key_fn(elem)), self.codec.encode(elem), []
        if pair and keyed:
            value = None if elem[1] is None else self.codec.encode(elem[1])  # None: a tombstone
            return key_bytes(elem[0]), value, []
        return None, self.codec.encode(elem), []
