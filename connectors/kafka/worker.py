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
    renew_shared_reader,
    shared_reader,
)
from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.outage import Wait, retrying, transient
from onceflow.kernel.ids import GAP_HEADER

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
    A Kafka that does not answer is waited for (see :class:`_Range`).
    """
    reading = _Range(settings, client, topic, part)
    position = lo
    start = reading.log_start(position)
    if start > position:
        yield _gap(topic, part, position, min(start, hi), hi, on_data_loss)
        position = min(start, hi)
    if position < hi:
        reading.reader.seek(topic, part, position)
    while position < hi:
        try:
            fetched = reading.reader.poll(POLL_S)
        except OffsetOutOfRange as exc:
            start = reading.log_start(position)
            if start <= position:
                msg = f"reading {topic}:{part} at offset {position} (log start {start}): {exc}"
                raise ConnectorError(msg) from exc
            yield _gap(topic, part, position, min(start, hi), hi, on_data_loss)
            reading.progressed()
            position = min(start, hi)
            if position < hi:
                reading.reader.seek(topic, part, position)
            continue
        first = bisect.bisect_left(fetched.offsets, position)
        last = bisect.bisect_left(fetched.offsets, hi)
        if last > first:
            position = fetched.offsets[last - 1] + 1
            yield _slice(fetched, first, last)
            reading.progressed()  # the stall clock counts polling, not the task's work
        else:
            position = max(position, _position(reading.reader) or position)
            if position < hi:
                reading.quiet((lo, hi, position))
    reading.reader.release()


class _Range:
    """The reader of one range, and what it knows of Kafka while no record comes.

    No record for :data:`QUIET_S`: the reader asks Kafka for the partition's log start (again
    every :data:`QUIET_S`). No answer is an outage, waited for (see :mod:`.outage`) with a new
    reader (a client that lost its way during the outage may not find it again). Answers
    start the stall clock: :data:`STALL_SECONDS` of them without a record mean the records
    are not coming (deleted by retention, or the broker lost them), and the task stops (a new
    reader takes over half-way, in case the old one lost its way). Time Kafka did not answer
    (a poll that blocked through an outage included) never counts as a stall.
    """

    def __init__(self, settings: KafkaSettings, client: str, topic: str, part: int) -> None:
        self.settings, self.client, self.topic, self.part = settings, client, topic, part
        self.doing = f"reading {topic}:{part}"
        self.reader: PartitionReader = retrying(
            settings, self.doing, lambda: shared_reader(client, settings)
        )
        self.outage: Wait | None = None
        self.checked = time.monotonic()
        self.answering_since: float | None = None  # Kafka answered, no record came since
        self.renewed = False  # a new reader since the last record

    def progressed(self) -> None:
        """Records came: the clocks start again."""
        self.checked = time.monotonic()
        self.answering_since = None
        self.outage = None
        self.renewed = False

    def log_start(self, position: int) -> int:
        """The partition's log start, waiting out Kafka (a new reader after each failure)."""
        return retrying(
            self.settings,
            self.doing,
            lambda: self.reader.log_start(self.topic, self.part),
            on_failure=lambda: self.renew(position),
        )

    def renew(self, position: int) -> None:
        """A new reader, reading from ``position``."""
        self.reader = retrying(
            self.settings,
            self.doing,
            lambda: renew_shared_reader(self.client, self.settings, self.reader),
        )
        self.reader.seek(self.topic, self.part, position)
        self.renewed = True

    def quiet(self, where: tuple[int, int, int]) -> None:
        """No record this poll: ask Kafka when due (see the class docstring)."""
        if time.monotonic() - self.checked <= QUIET_S:
            return
        position = where[2]
        try:
            self.reader.log_start(self.topic, self.part)
        except Exception as exc:
            if not transient(exc):
                raise
            self.answering_since = None
            self.outage = self.outage or Wait(self.settings, self.doing)
            self.outage.failed(exc)
            self.renew(position)
        else:
            self._answered(where)
        self.checked = time.monotonic()

    def _answered(self, where: tuple[int, int, int]) -> None:
        """Kafka answered while no record came (see the class docstring)."""
        self.outage = None
        now = time.monotonic()
        if self.answering_since is None:
            self.answering_since = now
        idle = now - self.answering_since
        lo, hi, position = where
        if idle > STALL_SECONDS / 2 and not self.renewed:
            self.renew(position)
        if idle <= STALL_SECONDS:
            return
        msg = (
            f"reading {self.topic}:{self.part} offsets {lo}..{hi} stalled at {position} for "
            f"{STALL_SECONDS} s while Kafka answered; were records deleted (retention)?"
        )
        raise ConnectorError(msg)


def _position(reader: PartitionReader) -> int | None:
    """The reader's position, None while it cannot say (Kafka away)."""
    try:
        return reader.position()
    except Exception as exc:
        if not transient(exc):
            raise
        return None


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
