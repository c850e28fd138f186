"""The Kafka clients the workers use, behind one small interface; topic administration.

Two libraries can read and write for the source's workers and the sink: kafka-python
(``client="python"``, the default) and confluent-kafka (``client="confluent"``, librdkafka in
C, installed with ``pip install 'onceflow[fast]'``; see :mod:`.confluent`). The source's and
sink's code is written once against what both expose (:mod:`.interface`, implemented in
:mod:`.kafka_python` and :mod:`.confluent`; this module creates and shares them):

* :class:`PartitionReader`: read one partition from an offset, ``read_committed``, as column
  batches (:class:`Fetched`), with the log start and the read position (which moves past
  transaction markers and aborted records even when no record comes back);
* :class:`Producer`: send a record with headers and a timestamp (a :class:`Delivery` says
  later whether the broker took it, and whether a refusal is for good: :attr:`~Delivery.poison`),
  flush, and Kafka transactions (init, begin, commit, abort).

The driver side (planning offsets, creating topics, consumer-group commits) always uses
kafka-python: it is not on the per-record path. Connection settings are
:class:`.connection.KafkaSettings`, in kafka-python's option names, resolved on
the driver and pickled to the workers; :mod:`.confluent` maps them to librdkafka's names on
the worker, when it creates a client. Clients are created lazily on the workers, never in a
connector's ``__init__``. Topic administration lives in :mod:`.admin` (``ensure_topics`` is
re-exported here).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from onceflow.connectors.kafka.admin import await_kafka, ensure_topics
from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.interface import (
    AUTO_CLIENT,
    CONFLUENT_CLIENT,
    FAST_EXTRA,
    NOTHING,
    PYTHON_CLIENT,
    READ_BATCH,
    WORKER_CLIENTS,
    Delivery,
    Fetched,
    Headers,
    KafkaUnavailable,
    OffsetOutOfRange,
    PartitionReader,
    Producer,
    ProducerBroken,
    ProducerFenced,
    RecordRefused,
    check_client,
    require_confluent,
    resolve_client,
)
from onceflow.connectors.kafka.kafka_python import PythonProducer, PythonReader

__all__ = [
    "AUTO_CLIENT",
    "CONFLUENT_CLIENT",
    "FAST_EXTRA",
    "NOTHING",
    "PYTHON_CLIENT",
    "READ_BATCH",
    "WORKER_CLIENTS",
    "Delivery",
    "Fetched",
    "Headers",
    "KafkaUnavailable",
    "OffsetOutOfRange",
    "PartitionReader",
    "Producer",
    "ProducerBroken",
    "ProducerFenced",
    "RecordRefused",
    "await_kafka",
    "check_client",
    "ensure_topics",
    "new_producer",
    "new_reader",
    "renew_shared_producer",
    "renew_shared_reader",
    "require_confluent",
    "resolve_client",
    "shared_producer",
    "shared_reader",
]


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


def renew_shared_reader(
    client: str, settings: KafkaSettings, old: PartitionReader
) -> PartitionReader:
    """Replace this process's shared reader ``old`` (it failed while Kafka was away).

    A client that lost its way during an outage may not find it again (measured: a
    kafka-python consumer after a rolling restart of three brokers asked for a partition's
    offsets in vain until the run gave up); a new one does. ``old`` is closed.
    """
    key = ("reader", client, _settings_key(settings, {}))
    with _shared_lock:
        if _shared.get(key) is old:
            del _shared[key]
    with contextlib.suppress(Exception):
        old.close()
    return shared_reader(client, settings)


def shared_producer(client: str, settings: KafkaSettings, config: dict[str, Any]) -> Producer:
    """This process's plain producer for ``client``, settings and ``config``."""
    key = ("producer", client, _settings_key(settings, config))
    with _shared_lock:
        producer = _shared.get(key)
        if producer is None:
            producer = _shared[key] = new_producer(client, settings, config)
    return producer


def renew_shared_producer(
    client: str, settings: KafkaSettings, config: dict[str, Any], old: Producer
) -> Producer:
    """Replace this process's shared producer ``old`` (it stopped making progress).

    ``old`` is closed at once (what it holds is dropped: its records are sent again).
    """
    key = ("producer", client, _settings_key(settings, config))
    with _shared_lock:
        if _shared.get(key) is old:
            del _shared[key]
    with contextlib.suppress(Exception):
        old.close(0)
    return shared_producer(client, settings, config)
