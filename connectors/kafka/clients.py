"""The Kafka clients the workers use, behind one small interface; topic administration.

Two libraries can read and write for the source's workers and the sink: kafka-python
(``client="python"``, the default) and confluent-kafka (``client="confluent"``, librdkafka in
C, installed with ``pip install 'onceflow[fast]'``; see :mod:`.confluent`). The source's and
sink's code is written once against what both expose here:

* :class:`PartitionReader`: read one partition from an offset, ``read_committed``, as column
  batches (:class:`Fetched`), with the log start and the read position (which moves past
  transaction markers and aborted records even when no record comes back);
* :class:`Producer`: send a record with headers and a timestamp (a :class:`Delivery` says
  later whether the broker took it, and whether a refusal is for good: :attr:`~Delivery.poison`),
  flush, and Kafka transactions (init, begin, commit, abort).

The driver side (planning offsets, creating topics, consumer-group commits) always uses
kafka-python: it is not on the per-record path. Connection settings are
:class:`~onceflow.kernel.settings.KafkaSettings`, in kafka-python's option names, resolved on
the driver and pickled to the workers; :mod:`.confluent` maps them to librdkafka's names on
the worker, when it creates a client. Clients are created lazily on the workers, never in a
connector's ``__init__``.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from onceflow.connectors.errors import ConnectorError
from onceflow.kernel.errors import ConfigError
from onceflow.kernel.settings import KafkaSettings

PYTHON_CLIENT = "python"
CONFLUENT_CLIENT = "confluent"
WORKER_CLIENTS = (PYTHON_CLIENT, CONFLUENT_CLIENT)
FAST_EXTRA = "pip install 'onceflow[fast]'"

Headers = list[tuple[str, bytes]]


class OffsetOutOfRange(ConnectorError):
    """The offset asked for is not in the partition's log (deleted, or not written yet)."""


class RecordRefused(ConnectorError):
    """The client refused a record before sending it, for good (too large for it)."""


class ProducerFenced(ConnectorError):
    """A newer producer registered the same transactional id: this one may not go on."""


def check_client(client: str, who: str, others: Sequence[str] = ()) -> None:
    """Refuse an unknown client; say how to install confluent-kafka when it is missing.

    ``others`` are further clients ``who`` accepts (the source's ``"spark"``).
    """
    known = (*WORKER_CLIENTS, *others)
    if client not in known:
        names = ", ".join(repr(c) for c in known)
        msg = f"{who} client must be one of {names}, got {client!r}"
        raise ConnectorError(msg)
    if client == CONFLUENT_CLIENT:
        require_confluent(who)


def require_confluent(who: str) -> None:
    """Raise a one-line :class:`ConfigError` when confluent-kafka cannot be imported."""
    try:
        found = importlib.util.find_spec("confluent_kafka") is not None
    except (ImportError, ValueError):  # a broken install, or the module set to None
        found = False
    if not found:
        msg = (
            f"{who}(client='confluent') needs the confluent-kafka package, which is not "
            f"installed here: {FAST_EXTRA} (on the driver and every worker), or use "
            "client='python'"
        )
        raise ConfigError(msg)


# -- reading ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fetched:
    """Records of one partition from one poll, as columns, offsets ascending."""

    offsets: list[int]
    timestamps: list[int]
    keys: list[bytes | None]
    values: list[bytes | None]
    headers: list[Headers | None]

    def __len__(self) -> int:
        return len(self.offsets)


NOTHING = Fetched([], [], [], [], [])


class PartitionReader(Protocol):
    """A ``read_committed`` reader of one partition at a time (see the module docstring)."""

    def log_start(self, topic: str, partition: int) -> int:
        """The first offset still in the partition's log."""

    def seek(self, topic: str, partition: int, offset: int) -> None:
        """Read this partition (and only it) from ``offset`` on."""

    def poll(self, timeout_s: float) -> Fetched:
        """The next records of the partition; raises :class:`OffsetOutOfRange`."""

    def position(self) -> int | None:
        """The offset the next read starts at (past markers and aborted records), if known."""

    def close(self) -> None:
        """Release the client."""


# -- writing ----------------------------------------------------------------------------------


class Delivery(Protocol):
    """What became of one sent record (known once the producer flushed)."""

    @property
    def done(self) -> bool:
        """Whether the broker answered (or the client gave up)."""

    @property
    def failure(self) -> str | None:
        """Why the record was not written; None when acknowledged or not done."""

    @property
    def poison(self) -> bool:
        """Whether the broker refused the record for good (a retry is refused again).

        A client may report a refusal of a whole record batch on every record of it (librdkafka
        does): the writer then sends each record on its own to find the culprits.
        """

    def where(self) -> tuple[str, int, int]:
        """Topic, partition and offset of an acknowledged record."""


class Producer(Protocol):
    """A producer, plain or transactional (see the module docstring)."""

    def send(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Headers | None,
        timestamp_ms: int | None,
    ) -> Delivery:
        """Queue a record; raises :class:`RecordRefused` for one the client refuses for good."""

    def flush(self, timeout_s: float) -> None:
        """Wait until every queued record is acknowledged or failed."""

    def init_transactions(self) -> None:
        """Register the transactional id: fences older producers of it, ends their transaction."""

    def begin(self) -> None:
        """Begin a transaction; raises :class:`ProducerFenced` when a newer producer took over."""

    def commit(self) -> None:
        """Commit the open transaction."""

    def abort(self) -> None:
        """Abort the open transaction."""

    def close(self, timeout_s: float) -> None:
        """Release the producer."""


def new_producer(client: str, settings: KafkaSettings, config: dict[str, Any]) -> Producer:
    """A producer of ``client`` with these settings; ``config`` in kafka-python's names.

    For confluent-kafka, ``config`` may also hold librdkafka properties (dotted names).
    """
    if client == CONFLUENT_CLIENT:
        from onceflow.connectors.kafka.confluent import ConfluentProducer

        return ConfluentProducer(settings, config)
    return PythonProducer(settings, config)


def new_reader(client: str, settings: KafkaSettings) -> PartitionReader:
    """A partition reader of ``client`` with these settings."""
    if client == CONFLUENT_CLIENT:
        from onceflow.connectors.kafka.confluent import ConfluentReader

        return ConfluentReader(settings)
    return PythonReader(settings)


_shared: dict[tuple[str, str, str], Any] = {}
_shared_lock = threading.Lock()


def _settings_key(settings: KafkaSettings, config: dict[str, Any]) -> str:
    items = (settings.bootstrap_servers, sorted(settings.options.items()), sorted(config.items()))
    return repr(items)


def shared_reader(client: str, settings: KafkaSettings) -> PartitionReader:
    """This process's reader for ``client`` and settings (a new client costs ~0.1 s)."""
    key = ("reader", client, _settings_key(settings, {}))
    with _shared_lock:
        reader = _shared.get(key)
        if reader is None:
            reader = _shared[key] = new_reader(client, settings)
    return reader


def shared_producer(client: str, settings: KafkaSettings, config: dict[str, Any]) -> Producer:
    """This process's plain producer for ``client``, settings and ``config``."""
    key = ("producer", client, _settings_key(settings, config))
    with _shared_lock:
        producer = _shared.get(key)
        if producer is None:
            producer = _shared[key] = new_producer(client, settings, config)
    return producer


# -- kafka-python -----------------------------------------------------------------------------

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
READ_BATCH = 5000


class PythonReader:
    """:class:`PartitionReader` over a kafka-python ``KafkaConsumer``."""

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

    def close(self) -> None:
        """Release the client."""
        self.consumer.close()


class PythonDelivery:
    """:class:`Delivery` of a kafka-python send (its future)."""

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
    """:class:`Producer` over a kafka-python ``KafkaProducer``."""

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


# -- topics -----------------------------------------------------------------------------------

# Let the cluster choose the replication factor (its default.replication.factor): a fixed 1
# would make acks=all meaningless on a cluster with replicas.
CLUSTER_DEFAULT_REPLICATION = -1


def ensure_topics(
    settings: KafkaSettings,
    topics: Sequence[str],
    partitions: int,
    configs: dict[str, str] | None = None,
) -> None:
    """Create missing topics with the cluster's default replication factor."""
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(**settings.client_config())
    try:
        existing = set(admin.list_topics())
        missing = [t for t in topics if t not in existing]
        if missing:
            try:
                admin.create_topics(
                    [
                        NewTopic(t, partitions, CLUSTER_DEFAULT_REPLICATION, topic_configs=configs)
                        for t in missing
                    ]
                )
            except TopicAlreadyExistsError:
                pass
    finally:
        admin.close()
