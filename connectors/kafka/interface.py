"""What the Kafka source's workers and the sink need of a client library, and its errors.

Implemented over kafka-python (:mod:`.kafka_python`) and confluent-kafka (:mod:`.confluent`);
:mod:`.clients` creates them. See :mod:`.clients` for the whole picture.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from onceflow.connectors.errors import ConnectorError
from onceflow.kernel.errors import ConfigError

PYTHON_CLIENT = "python"
CONFLUENT_CLIENT = "confluent"
AUTO_CLIENT = "auto"  # confluent-kafka where it can be imported, else kafka-python
WORKER_CLIENTS = (PYTHON_CLIENT, CONFLUENT_CLIENT)
FAST_EXTRA = "pip install confluent-kafka"
READ_BATCH = 5000  # at most this many records come back from one poll of either reader

Headers = list[tuple[str, bytes]]


class OffsetOutOfRange(ConnectorError):
    """The offset asked for is not in the partition's log (deleted, or not written yet)."""


class RecordRefused(ConnectorError):
    """The client refused a record before sending it, for good (too large for it)."""


class ProducerBroken(ConnectorError):
    """A transactional producer cannot go on with its transaction (it must be replaced)."""


class ProducerFenced(ProducerBroken):
    """A newer producer registered the same transactional id: this one may not go on."""


class KafkaUnavailable(ConnectorError):
    """Kafka did not answer in time, or a client lost its way while a broker was away.

    Transient: the step is tried again until Kafka is back or the outage bound has passed
    (see :mod:`.outage`, whose last one is raised with the line the run ends with).
    """


def check_client(client: str, who: str, others: Sequence[str] = ()) -> None:
    """Refuse an unknown client; say how to install confluent-kafka when it is missing.

    ``others`` are further clients ``who`` accepts (the source's ``"spark"``).
    """
    known = (AUTO_CLIENT, *WORKER_CLIENTS, *others)
    if client not in known:
        names = ", ".join(repr(c) for c in known)
        msg = f"{who} client must be one of {names}, got {client!r}"
        raise ConnectorError(msg)
    if client == CONFLUENT_CLIENT:
        require_confluent(who)


def resolve_client(client: str) -> str:
    """The client ``client`` names; ``"auto"`` (the default) is resolved here.

    ``"auto"`` is confluent-kafka (librdkafka, a dependency of Onceflow) when it can be
    imported here, else kafka-python.

    Resolved once, on the driver, when the source or sink is made: the workers get the
    resolved name with the pickled connector.
    """
    if client != AUTO_CLIENT:
        return client
    return CONFLUENT_CLIENT if confluent_installed() else PYTHON_CLIENT


def confluent_installed() -> bool:
    """Whether confluent-kafka can be imported in this interpreter."""
    try:
        return importlib.util.find_spec("confluent_kafka") is not None
    except (ImportError, ValueError):  # a broken install, or the module set to None
        return False


def require_confluent(who: str) -> None:
    """Raise a one-line :class:`ConfigError` when confluent-kafka cannot be imported."""
    if not confluent_installed():
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

    def release(self) -> None:
        """Stop fetching until the next :meth:`seek` (the range asked for was read)."""

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
        """Wait (at most ``timeout_s``) until every queued record is acknowledged or failed."""

    def init_transactions(self, timeout_s: float) -> None:
        """Register the transactional id: fences older producers of it, ends their transaction.

        Raises :class:`KafkaUnavailable` when Kafka does not answer within ``timeout_s``.
        """

    def begin(self) -> None:
        """Begin a transaction; raises :class:`ProducerFenced` when a newer producer took over."""

    def commit(self, timeout_s: float) -> None:
        """Commit the open transaction.

        Raises :class:`KafkaUnavailable` when it is not answered within ``timeout_s`` (its fate
        is then unknown; a call again goes on waiting for it), :class:`ProducerBroken` when it
        failed (:class:`ProducerFenced`: a newer producer of the id took over).
        """

    def abort(self, timeout_s: float) -> None:
        """Abort the open transaction (raises as :meth:`commit` does)."""

    def close(self, timeout_s: float) -> None:
        """Release the producer."""
