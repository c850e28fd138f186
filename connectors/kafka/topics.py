"""Producing to and reading whole topics, outside Spark: for the demo, audits and tests."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.kafka.clients import ensure_topics
from onceflow.connectors.kafka.connection import KafkaSettings


@dataclass(frozen=True)
class TopicRecord:
    """One record read back from a topic."""

    partition: int
    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None
    headers: dict[str, bytes]


def produce(
    settings: KafkaSettings,
    topic: str,
    records: Iterable[tuple[bytes | None, bytes, list[tuple[str, bytes]] | None]],
    *,
    partitions: int = 2,
    partitioner: Any = None,
) -> int:
    """Send ``(key, value, headers)`` records (creating the topic); return how many."""
    from kafka import KafkaProducer

    ensure_topics(settings, [topic], partitions)
    producer = KafkaProducer(
        **settings.client_config(), acks="all", linger_ms=5, batch_size=256 * 1024
    )
    n = 0
    try:
        for key, value, headers in records:
            partition = partitioner(n, key) if partitioner is not None else None
            producer.send(topic, key=key, value=value, headers=headers, partition=partition)
            n += 1
        producer.flush(timeout=120)
    finally:
        producer.close()
    return n


def read_topic(
    settings: KafkaSettings,
    topic: str,
    timeout: float = 60.0,
    committed: bool = True,
    start: Mapping[int, int] | None = None,
) -> list[TopicRecord]:
    """Every record of ``topic``, partition by partition, as a reader outside Onceflow sees it.

    ``committed`` (the default) reads as ``read_committed`` consumers do, up to the last
    stable offsets (records of aborted transactions are not seen); False reads everything up
    to the high-water marks, aborted records included. ``start`` maps partitions to the
    offset to read from (records before it are skipped; the beginning by default).
    """
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(
        **settings.client_config(),
        enable_auto_commit=False,
        max_poll_records=5000,
        isolation_level="read_committed" if committed else "read_uncommitted",
    )
    try:
        parts = consumer.partitions_for_topic(topic)
        if not parts:
            msg = f"topic {topic!r} does not exist at {settings.bootstrap_servers}"
            raise ConnectorError(msg)
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        consumer.assign(tps)
        begin = consumer.beginning_offsets(tps)
        for tp in tps:
            consumer.seek(tp, max(begin[tp], (start or {}).get(tp.partition, 0)))
        out: list[TopicRecord] = []
        done: set[int] = set()
        deadline = time.monotonic() + timeout
        stable = committed and os.environ.get("ONCEFLOW_KAFKA_END_OFFSETS") != "highwater"
        ends = consumer.end_offsets(tps) if stable else {}
        while len(done) < len(tps):
            if time.monotonic() > deadline:
                msg = f"reading {topic!r} did not reach its end within {timeout:.0f} s"
                raise ConnectorError(msg)
            for records in consumer.poll(timeout_ms=200).values():
                out.extend(
                    TopicRecord(
                        r.partition, r.offset, r.timestamp, r.key, r.value, dict(r.headers or [])
                    )
                    for r in records
                )
            for tp in tps:
                end = ends.get(tp) if stable else consumer.highwater(tp)
                if end is not None and consumer.position(tp) >= end:
                    done.add(tp.partition)
        return out
    finally:
        consumer.close()
