"""The delivery log: one marker record per Kafka transaction of a transactional sink.

Each transaction of a sink partition carries a marker in the pipeline's delivery log topic
(``<pipeline>.onceflow-deliveries``, compacted: only each partition's newest marker is
needed). The runtime records the marker's place in Redis as the pending delivery before it
commits; after a crash, reading the marker with a ``read_committed`` reader says whether that
transaction committed. The marker's text is built and parsed here only:
``topic|partition|offset|delivery id``.

A marker record's value is the delivery id, then ``@`` and the delivery's mark
(:class:`~onceflow.connectors.base.DeliveryMark`: micro-batch, number, digest of its
records) when the runtime gave one: read back by :func:`delivered_marks`, it tells which
deliveries of a micro-batch committed even when Redis lost every record of them.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from typing import Any

from onceflow.connectors.base import DeliveryMark, TaskInfo
from onceflow.connectors.kafka.clients import PYTHON_CLIENT, Delivery, PartitionReader, new_reader
from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.outage import Wait, transient

MARK_SEPARATOR = "@"  # between a marker record's delivery id and its mark
SCAN_POLL_MS = 500

DELIVERY_LOG_SUFFIX = "onceflow-deliveries"
# The delivery log only needs each sink partition's newest marker.
DELIVERY_LOG_CONFIG = {"cleanup.policy": "compact"}


def delivery_id(task: TaskInfo, n: int) -> str:
    """The ``n``-th delivery of a task's attempt: ``batch.partition.attempt.n``."""
    return f"{task.batch}.{task.partition}.{task.attempt_id}.{n}"


def marker_value(delivery: str, mark: DeliveryMark | None) -> bytes:
    """A marker record's value: the delivery id, and its mark if it has one."""
    return (delivery if mark is None else f"{delivery}{MARK_SEPARATOR}{mark.text()}").encode()


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


def delivered_marks(
    settings: KafkaSettings,
    topic: str,
    key: bytes,
    since: str | None,
    batch: int,
    incarnation: str,
) -> list[DeliveryMark]:
    """The marks of committed marker records of ``key`` for ``batch`` of ``incarnation``.

    Read ``read_committed`` from ``since`` (a marker of ``key`` that Redis knows: every later
    one lies after it) or else from the log's start, up to where the log ends when the read
    begins: every transaction of ``key`` is over by then (the caller settled them), so each
    of its markers there is either committed (read) or aborted (never read). A transaction of
    another sink partition still open holds the read back until it ends; Kafka away is waited
    for within the outage bound (see :mod:`.outage`). kafka-python, on the driver's side of
    the client interface: this read is rare (a batch run again after Redis went back).
    """
    wait = Wait(settings, f"reading the delivery log {topic!r}")
    while True:
        try:
            return _scan(settings, topic, key, _starts(since, topic), (batch, incarnation), wait)
        except Exception as exc:
            if not transient(exc):
                raise
            wait.failed(exc)


def _starts(since: str | None, topic: str) -> dict[int, int]:
    """Where to start reading each partition of the log: past ``since``'s marker."""
    if since is None:
        return {}
    parts = since.split("|", 3)
    if len(parts) != 4 or parts[0] != topic or not parts[2].isdigit():  # noqa: PLR2004
        return {}
    return {int(parts[1]): int(parts[2]) + 1}


def _scan(
    settings: KafkaSettings,
    topic: str,
    key: bytes,
    starts: dict[int, int],
    wanted: tuple[int, str],
    wait: Wait,
) -> list[DeliveryMark]:
    """One read of the log (see :func:`delivered_marks`); ``wanted``: (batch, incarnation)."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(
        **settings.client_config(),
        enable_auto_commit=False,
        group_id=None,
        isolation_level="read_committed",
        max_poll_records=5000,
    )
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        if not tps:
            return []
        consumer.assign(tps)
        begin = consumer.beginning_offsets(tps)
        for tp in tps:
            consumer.seek(tp, max(int(begin[tp]), starts.get(tp.partition, 0)))
        return _read_to_end(consumer, tps, key, wanted, wait)
    finally:
        consumer.close()


def _read_to_end(
    consumer: Any, tps: list[Any], key: bytes, wanted: tuple[int, str], wait: Wait
) -> list[DeliveryMark]:
    """Poll until every partition's position passed its high-water mark of the first fetch.

    A read that stops moving short of it (held back by a transaction still open) counts
    against ``wait``'s bound.
    """
    found: list[tuple[int, int, DeliveryMark]] = []
    ends: dict[Any, int] = {}
    at: list[int] = []
    while True:
        for tp, records in consumer.poll(timeout_ms=SCAN_POLL_MS).items():
            for r in records:
                mark = _mark_of(r.key, r.value, key)
                if mark is not None and (mark.batch, mark.incarnation) == wanted:
                    found.append((tp.partition, r.offset, mark))
        for tp in tps:
            high = consumer.highwater(tp)
            if tp not in ends and high is not None:
                ends[tp] = int(high)
        now = [int(consumer.position(tp)) for tp in tps]
        if len(ends) == len(tps) and all(p >= ends[tp] for p, tp in zip(now, tps, strict=True)):
            return [mark for _, _, mark in sorted(found, key=lambda f: (f[0], f[1]))]
        if now == at:
            wait.note("the delivery log's committed records end before its last ones")
        at = now
        time.sleep(0.01)


def _mark_of(record_key: bytes | None, value: bytes | None, key: bytes) -> DeliveryMark | None:
    """The mark in a marker record of ``key``, if it has one."""
    if record_key != key or not value:
        return None
    _, sep, mark = value.decode(errors="replace").partition(MARK_SEPARATOR)
    return DeliveryMark.parse(mark) if sep else None
