"""Kafka on the workers: reading one offset range.

A worker reads ``[lo, hi)`` of one topic-partition with a reader shared by the Python worker
process (a new one costs ~0.1 s), of either client (:mod:`.clients`). :func:`fetch_range`
yields the records as columns (what the source stage decodes: the stage reads its own range,
see :class:`~.datasource.KafkaDataSource`); :func:`raw_rows` makes a poll's records an Arrow
batch of raw rows.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import msgpack

from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.kafka.clients import (
    PYTHON_CLIENT,
    Fetched,
    OffsetOutOfRange,
    PartitionReader,
    shared_reader,
)
from onceflow.connectors.kafka.outage import Wait, retrying, transient
from onceflow.kernel.ids import GAP_HEADER
from onceflow.kernel.settings import KafkaSettings

if TYPE_CHECKING:
    import pyarrow as pa

RAW_SCHEMA = (
    "topic string, partition int, offset long, ts long, key binary, value binary, headers binary"
)
RAW_COLUMNS = ("topic", "partition", "offset", "ts", "key", "value", "headers")
# A range of records the source stage reads itself: ``[lo, hi)`` of one topic-partition.
RANGE_SCHEMA = "topic string, partition int, lo long, hi long"
RANGE_COLUMNS = ("topic", "partition", "lo", "hi")
POLL_S = 0.5
STALL_SECONDS = 60  # no record while Kafka answers: the records are not coming
QUIET_S = 5.0  # no record for this long: is Kafka there? (asked again this often)


ON_DATA_LOSS = ("fail", "report")


def fetch_range(
    settings: KafkaSettings,
    topic: str,
    part: int,
    lo: int,
    hi: int,
    on_data_loss: str = "fail",
    client: str = PYTHON_CLIENT,
) -> Iterator[Fetched]:
    """Records ``[lo, hi)`` of one topic-partition, read with ``client``, as columns.

    Records of the range that are gone (deleted by retention or ``delete_records`` before
    they were read) are never skipped silently: with ``on_data_loss="fail"`` the task stops
    with an error saying which; with ``"report"`` one marker row (header ``onceflow-gap``)
    stands for them, and reading goes on from the log start. A record is yielded once even
    if the client hands it over twice (only offsets at or past the read position count).
    A Kafka that does not answer is waited for (see :mod:`.outage` and :func:`_quiet`).
    """
    doing = f"reading {topic}:{part}"
    reader = retrying(settings, doing, lambda: shared_reader(client, settings))
    position = lo
    start = retrying(settings, doing, lambda: reader.log_start(topic, part))
    if start > position:
        yield _gap(topic, part, position, min(start, hi), hi, on_data_loss)
        position = min(start, hi)
    if position < hi:
        reader.seek(topic, part, position)
    idle_since = checked = time.monotonic()
    outage: Wait | None = None
    while position < hi:
        try:
            fetched = reader.poll(POLL_S)
        except OffsetOutOfRange as exc:
            start = retrying(settings, doing, lambda: reader.log_start(topic, part))
            if start <= position:
                msg = f"reading {topic}:{part} at offset {position} (log start {start}): {exc}"
                raise ConnectorError(msg) from exc
            yield _gap(topic, part, position, min(start, hi), hi, on_data_loss)
            idle_since = time.monotonic()
            position = min(start, hi)
            if position < hi:
                reader.seek(topic, part, position)
            continue
        first = bisect.bisect_left(fetched.offsets, position)
        last = bisect.bisect_left(fetched.offsets, hi)
        if last > first:
            position = fetched.offsets[last - 1] + 1
            yield _slice(fetched, first, last)
            # the stall clock counts polling only
            idle_since = checked = time.monotonic()
            outage = None
        else:
            position = max(position, _position(reader) or position)
            if position < hi and time.monotonic() - checked > QUIET_S:
                where = (topic, part, lo, hi, position)
                outage, idle_since = _quiet(reader, settings, where, outage, idle_since)
                checked = time.monotonic()
    reader.release()


def _position(reader: PartitionReader) -> int | None:
    """The reader's position, None while it cannot say (Kafka away)."""
    try:
        return reader.position()
    except Exception as exc:
        if not transient(exc):
            raise
        return None


def _quiet(
    reader: PartitionReader,
    settings: KafkaSettings,
    where: tuple[str, int, int, int, int],
    outage: Wait | None,
    idle_since: float,
) -> tuple[Wait | None, float]:
    """No record for a while: an outage (waited for), a stall (an error) or nothing yet.

    The reader asks Kafka for the partition's log start. No answer is an outage, which goes
    on (the returned wait) until Kafka answers or its bound passes. An answer after an
    outage restarts the stall clock (the returned time: the reader catches up); an answer
    after :data:`STALL_SECONDS` without a record otherwise means the records are not coming
    (deleted by retention, or the broker lost them): the task stops.
    """
    topic, part, lo, hi, position = where
    try:
        reader.log_start(topic, part)
    except Exception as exc:
        if not transient(exc):
            raise
        outage = outage or Wait(settings, f"reading {topic}:{part}")
        outage.failed(exc)
        return outage, idle_since
    if outage is not None:
        return None, time.monotonic()
    if time.monotonic() - idle_since <= STALL_SECONDS:
        return None, idle_since
    msg = (
        f"reading {topic}:{part} offsets {lo}..{hi} stalled at {position} for "
        f"{STALL_SECONDS} s while Kafka answered; were records deleted (retention)?"
    )
    raise ConnectorError(msg)


def _slice(fetched: Fetched, first: int, last: int) -> Fetched:
    """Records ``first:last`` of a poll (the poll itself when that is all of it)."""
    if first == 0 and last == len(fetched):
        return fetched
    return Fetched(
        fetched.offsets[first:last],
        fetched.timestamps[first:last],
        fetched.keys[first:last],
        fetched.values[first:last],
        fetched.headers[first:last],
    )


def raw_rows(topic: str, part: int, fetched: Fetched) -> pa.RecordBatch:
    """Records of a poll as an Arrow batch of raw rows."""
    import pyarrow as pa

    n = len(fetched)
    return pa.RecordBatch.from_arrays(
        [
            pa.array([topic] * n, pa.string()),
            pa.array([part] * n, pa.int32()),
            pa.array(fetched.offsets, pa.int64()),
            pa.array(fetched.timestamps, pa.int64()),
            pa.array(fetched.keys, pa.binary()),
            pa.array(fetched.values, pa.binary()),
            pa.array([pack_headers(h) for h in fetched.headers], pa.binary()),
        ],
        names=list(RAW_COLUMNS),
    )


def _gap(topic: str, part: int, first: int, after: int, hi: int, on_data_loss: str) -> Fetched:
    """The marker row for offsets ``[first, after)`` that are gone, or the error."""
    if on_data_loss != "report":
        msg = (
            f"Kafka {topic}:{part} offsets {first}..{after - 1} were deleted (retention or "
            f"delete_records) before the pipeline read them ({after - first} records, of the "
            f"range up to {hi}). Nothing was skipped: the run stops. To go on from the log "
            "start and record the gap as a dead letter, set KafkaSource(on_data_loss='report')"
        )
        raise ConnectorError(msg)
    return Fetched([first], [0], [None], [None], [[(GAP_HEADER, f"{first}-{after}".encode())]])


def pack_headers(headers: Sequence[tuple[str, bytes]] | None) -> bytes | None:
    """Record headers as one MessagePack list of ``[key, value]`` (None when there are none)."""
    if not headers:
        return None
    return msgpack.packb([[k, v] for k, v in headers], use_bin_type=True)  # type: ignore[no-any-return]
