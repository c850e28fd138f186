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
from onceflow.kernel.ids import GAP_HEADER
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


ON_DATA_LOSS = ("fail", "report")


def read_range(
    settings: KafkaSettings,
    topic: str,
    part: int,
    lo: int,
    hi: int,
    on_data_loss: str = "fail",
) -> Iterator[pa.RecordBatch]:
    """Records ``[lo, hi)`` of one topic-partition, as Arrow batches.

    Records of the range that are gone (deleted by retention or ``delete_records`` before
    they were read) are never skipped silently: with ``on_data_loss="fail"`` the task stops
    with an error saying which; with ``"report"`` one marker row (header ``onceflow-gap``)
    stands for them, and reading goes on from the log start.
    """
    import pyarrow as pa
    from kafka import TopicPartition
    from kafka.errors import OffsetOutOfRangeError

    tp = TopicPartition(topic, part)
    consumer = shared_client(
        "reader",
        settings,
        enable_auto_commit=False,
        max_poll_records=MAX_POLL_RECORDS,
        group_id=None,
        auto_offset_reset="none",  # out of range raises: never jump over records
        isolation_level="read_committed",  # never records of aborted or open transactions
    )
    consumer.assign([tp])
    position = lo
    start = consumer.beginning_offsets([tp])[tp]
    if start > position:
        yield _gap(topic, part, position, min(start, hi), hi, on_data_loss)
        position = min(start, hi)
    if position < hi:
        consumer.seek(tp, position)
    idle_since = time.monotonic()
    while position < hi:
        try:
            batch = consumer.poll(timeout_ms=POLL_MS).get(tp, [])
        except OffsetOutOfRangeError:
            start = consumer.beginning_offsets([tp])[tp]
            if start <= position:
                raise
            yield _gap(topic, part, position, min(start, hi), hi, on_data_loss)
            position = min(start, hi)
            if position < hi:
                consumer.seek(tp, position)
            continue
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


def _gap(
    topic: str, part: int, first: int, after: int, hi: int, on_data_loss: str
) -> pa.RecordBatch:
    """The marker row for offsets ``[first, after)`` that are gone, or the error."""
    import pyarrow as pa

    if on_data_loss != "report":
        msg = (
            f"Kafka {topic}:{part} offsets {first}..{after - 1} were deleted (retention or "
            f"delete_records) before the pipeline read them ({after - first} records, of the "
            f"range up to {hi}). Nothing was skipped: the run stops. To go on from the log "
            "start and record the gap as a dead letter, set KafkaSource(on_data_loss='report')"
        )
        raise ConnectorError(msg)
    headers = pack_headers([(GAP_HEADER, f"{first}-{after}".encode())])
    return pa.RecordBatch.from_arrays(
        [
            pa.array([topic], pa.string()),
            pa.array([part], pa.int32()),
            pa.array([first], pa.int64()),
            pa.array([0], pa.int64()),
            pa.array([None], pa.binary()),
            pa.array([None], pa.binary()),
            pa.array([headers], pa.binary()),
        ],
        names=list(RAW_COLUMNS),
    )


def pack_headers(headers: Sequence[tuple[str, bytes]] | None) -> bytes | None:
    """Record headers as one MessagePack list of ``[key, value]`` (None when there are none)."""
    if not headers:
        return None
    return msgpack.packb([[k, v] for k, v in headers], use_bin_type=True)  # type: ignore[no-any-return]
