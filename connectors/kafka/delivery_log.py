"""The delivery log: one marker record per Kafka transaction of a transactional sink.

Each transaction of a sink partition carries a marker in the pipeline's delivery log topic
(``<pipeline>.onceflow-deliveries``, compacted: only each partition's newest marker is
needed). The runtime records the marker's place in Redis as the pending delivery before it
commits; after a crash, reading the marker with a ``read_committed`` reader says whether that
transaction committed. The marker's text is built and parsed here only:
``topic|partition|offset|delivery id``.
"""

from __future__ import annotations

import bisect
import contextlib

from onceflow.connectors.base import TaskInfo
from onceflow.connectors.kafka.clients import PYTHON_CLIENT, Delivery, PartitionReader, new_reader
from onceflow.connectors.kafka.outage import Wait, transient
from onceflow.kernel.settings import KafkaSettings

DELIVERY_LOG_SUFFIX = "onceflow-deliveries"
# The delivery log only needs each sink partition's newest marker.
DELIVERY_LOG_CONFIG = {"cleanup.policy": "compact"}


def delivery_id(task: TaskInfo, n: int) -> str:
    """The ``n``-th delivery of a task's attempt: ``batch.partition.attempt.n``."""
    return f"{task.batch}.{task.partition}.{task.attempt_id}.{n}"


def took(marker: Delivery | None) -> bool:
    """Whether the broker acknowledged the delivery marker."""
    return marker is not None and marker.done and marker.failure is None


def marker_text(marker: Delivery, delivery: str) -> str:
    """What the runtime records of an acknowledged marker: ``topic|partition|offset|delivery``."""
    topic, partition, offset = marker.where()
    return f"{topic}|{partition}|{offset}|{delivery}"


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
