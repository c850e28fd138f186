"""Kafka as a Spark Python data source, on the workers: reading one offset range.

A worker reads ``[lo, hi)`` of one topic-partition with a consumer shared by the Python
worker process (a new one costs ~0.1 s) and yields Arrow batches of raw rows.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import msgpack

from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.kafka.clients import shared_client
from onceflow.kernel.settings import KafkaSettings

if TYPE_CHECKING:
    import pyarrow as pa

RAW_SCHEMA = (
    "topic string, partition int, offset long, ts long, key binary, value binary, headers binary"
)
RAW_COLUMNS = ("topic", "partition", "offset", "ts", "key", "value", "headers")
MAX_POLL_RECORDS = 5000
POLL_MS = 500
STALL_SECONDS = 60


def read_range(
    settings: KafkaSettings, topic: str, part: int, lo: int, hi: int
) -> Iterator[pa.RecordBatch]:
    """Records ``[lo, hi)`` of one topic-partition, as Arrow batches."""
    import pyarrow as pa
    from kafka import TopicPartition

    tp = TopicPartition(topic, part)
    consumer = shared_client(
        "reader",
        settings,
        enable_auto_commit=False,
        max_poll_records=MAX_POLL_RECORDS,
        group_id=None,
    )
    consumer.assign([tp])
    consumer.seek(tp, lo)
    position = lo
    idle_since = time.monotonic()
    while position < hi:
        batch = consumer.poll(timeout_ms=POLL_MS).get(tp, [])
        rows = [r for r in batch if lo <= r.offset < hi]
        if rows:
            idle_since = time.monotonic()
            position = rows[-1].offset + 1
            yield pa.RecordBatch.from_arrays(
                [
                    pa.array([topic] * len(rows), pa.string()),
                    pa.array([part] * len(rows), pa.int32()),
                    pa.array([r.offset for r in rows], pa.int64()),
                    pa.array([r.timestamp for r in rows], pa.int64()),
                    pa.array([r.key for r in rows], pa.binary()),
                    pa.array([r.value for r in rows], pa.binary()),
                    pa.array([pack_headers(r.headers) for r in rows], pa.binary()),
                ],
                names=list(RAW_COLUMNS),
            )
        else:
            position = max(position, consumer.position(tp))
            if time.monotonic() - idle_since > STALL_SECONDS:
                msg = (
                    f"reading {topic}:{part} offsets {lo}..{hi} stalled at {position} for "
                    f"{STALL_SECONDS} s; were records deleted (retention) or is the broker down?"
                )
                raise ConnectorError(msg)


def pack_headers(headers: Sequence[tuple[str, bytes]] | None) -> bytes | None:
    """Record headers as one MessagePack list of ``[key, value]`` (None when there are none)."""
    if not headers:
        return None
    return msgpack.packb([[k, v] for k, v in headers], use_bin_type=True)  # type: ignore[no-any-return]
