"""Reading a task's input: decoding a source's raw rows or another stage's rows into chunks.

A source's records are decoded a slice at a time (a source's Arrow batch may stand for a
whole offset range its task reads itself); undecodable and oversized records become dead
letters on the way. Rows are then cut into chunks (:mod:`~.chunking`), each with the newest
event time per source lane among its rows and the lane heartbeats decoded so far.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import repeat
from operator import itemgetter
from typing import TYPE_CHECKING

from onceflow.connectors.decoded import LaneProgress, RecordColumns
from onceflow.kernel import codec
from onceflow.kernel.limits import SOURCE_SLICE_RECORDS, Budget
from onceflow.kernel.records import DeadLetter, InRow, Record
from onceflow.runtime.guard import Guard
from onceflow.runtime.ops.body import StageBody
from onceflow.runtime.ops.record_text import Origins, describe, too_large
from onceflow.runtime.spec import StageSpec
from onceflow.runtime.task.chunking import Chunker, Part

if TYPE_CHECKING:
    import pyarrow as pa

MAX_ORIGINS = 50_000  # source records whose origin a task remembers for error messages
ROW_COLUMNS = ("id", "ts", "key", "value", "port")

_TS = itemgetter(2)
Count = Callable[[str, int], None]
Chunk = tuple[list[InRow], dict[str, int], list[bool], list[int]]


class TaskInput:
    """A task's input, decoded and cut into chunks of the guard's records and bytes.

    ``origins`` remembers where the current input's source records were read (for error
    messages and dead letters); ``letter_bytes`` what the dead letters made while decoding
    weigh, not yet committed (the task zeroes it with each chunk).
    """

    def __init__(self, spec: StageSpec, guard: Guard, body: StageBody, count: Count) -> None:
        self.spec = spec
        self.guard = guard
        self.body = body
        self.count = count
        self.origins = Origins()  # source records of the current input batch
        self.progress: dict[str, int] = {}  # lane heartbeats not yet sent with a chunk
        self.letter_bytes = 0  # payload of dead letters made while decoding, not committed

    def chunks(self, batches: Iterator[pa.RecordBatch]) -> Iterator[Chunk]:
        """Input rows in chunks of the guard's records and bytes (:mod:`~.chunking`).

        Each chunk comes with the newest event time per source lane among its rows that are
        not too far ahead of the clock (nothing for stages that read other stages), with the
        lane heartbeats (:class:`LaneProgress`) decoded so far, with which rows have
        positional IDs and with their content fingerprints (empty lists for stages that read
        other stages); heartbeats after
        the last row leave in a chunk of no rows, and so do dead letters made while decoding
        once they weigh a chunk's bytes. Bounded runs (``chunk_size`` 0) cut chunks within
        each Arrow batch, by bytes only.
        """
        parts = self.source_rows(batches) if self.spec.source else self.internal_rows(batches)
        whole_batches = self.guard.chunk_size <= 0
        chunker = Chunker(Budget(max(self.guard.chunk_size, 0), self.guard.chunk_bytes))
        for part in parts:
            chunks = [*chunker.add(part), *chunker.flush()] if whole_batches else chunker.add(part)
            for chunk in chunks:
                marks = self._lane_marks(chunk.rows, chunk.lanes)
                yield chunk.rows, marks, chunk.positional, chunk.fingerprints
            if self.letter_bytes >= self.guard.chunk_bytes or (whole_batches and not part.rows):
                yield [], self._lane_marks([], []), [], []
        for chunk in chunker.flush():
            marks = self._lane_marks(chunk.rows, chunk.lanes)
            yield chunk.rows, marks, chunk.positional, chunk.fingerprints
        if self.progress:
            yield [], self._lane_marks([], []), [], []

    def _lane_marks(self, rows: list[InRow], lanes: list[str | None]) -> dict[str, int]:
        """Newest admissible event time per lane (rows too far ahead do not count).

        Heartbeats decoded so far join the marks (and are then forgotten).
        """
        marks = dict(self.progress)
        self.progress.clear()
        if not lanes:
            return marks
        limit = self.guard.limit_ms
        one = len(set(lanes)) == 1
        for lane in filter(None, set(lanes)):
            if one:
                times = list(map(_TS, rows))
            else:
                times = [row[2] for row, at in zip(rows, lanes, strict=True) if at == lane]
            if limit is not None and max(times) > limit:
                times = [ts for ts in times if ts <= limit]
            newest = max(times, default=None)
            if newest is not None and newest > marks.get(lane, newest - 1):
                marks[lane] = newest
        return marks

    def _heartbeat(self, beat: LaneProgress) -> None:
        """Remember a lane heartbeat, capped at the batch's time (bounded runs ignore it)."""
        now = self.guard.batch_time_ms
        if now is None:
            return
        ts = min(beat.ts, now)
        if ts > self.progress.get(beat.lane, ts - 1):
            self.progress[beat.lane] = ts

    def source_rows(self, batches: Iterator[pa.RecordBatch]) -> Iterator[Part]:
        """Decode a source's raw rows, in slices of at most a chunk's records and bytes.

        A source's Arrow batch may stand for a whole offset range its task reads itself (see
        :mod:`onceflow.connectors.kafka.datasource`): its records are handed on a slice at a
        time, not all decoded first. Undecodable records, and records over
        ``max_record_bytes`` (:meth:`_too_large_input`), become dead letters. Records a
        decoder hands over as columns (:class:`~onceflow.connectors.base.RecordColumns`) are
        taken a list at a time; the rest one by one.
        """
        decoder = self.spec.source_connector.decoder(self.spec.source, self.guard.mode.ids)
        slicer = _Slicer(SOURCE_SLICE_RECORDS, self.guard.chunk_bytes)
        for batch in batches:
            for item in decoder(batch):
                if isinstance(item, RecordColumns):
                    yield from self._columns(item, slicer)
                    continue
                yield from self._hand_on(slicer)
                if isinstance(item, Record):
                    self._record(item, slicer)
                elif isinstance(item, LaneProgress):
                    self._heartbeat(item)
                else:
                    assert isinstance(item, DeadLetter)
                    slicer.size += self._letter(item)
            yield from self._hand_on(slicer, end=True)

    def _hand_on(self, slicer: _Slicer, end: bool = False) -> Iterator[Part]:
        """The slice, if full (or at the ``end`` of an input batch); bounds the origins kept."""
        yield from slicer.cut() if end else slicer.full()
        if len(self.origins) > MAX_ORIGINS:
            self.origins.clear()

    def _columns(self, cols: RecordColumns, slicer: _Slicer) -> Iterator[Part]:
        """A lane's records as columns, into slices (a record over the limit: one by one)."""
        limit = self.spec.max_record_bytes
        if cols.sizes and max(cols.sizes) > limit:
            for rec in cols.records():
                yield from self._hand_on(slicer)
                self._record(rec, slicer)
            return
        start, n = 0, len(cols)
        while start < n:
            yield from self._hand_on(slicer)
            end = slicer.take(cols.sizes, start)
            part = slicer.part
            part.rows.extend(
                zip(
                    repeat(0, end - start),
                    cols.ids[start:end],
                    cols.ts[start:end],
                    repeat(None, end - start),
                    cols.elems[start:end],
                    strict=True,
                )
            )
            part.lanes.extend(repeat(cols.lane, end - start))
            part.positional.extend(cols.positional[start:end])
            part.sizes.extend(cols.sizes[start:end])
            part.fingerprints.extend(cols.fingerprints[start:end])
            self.origins.add_columns(cols.ids[start:end], cols.lane, cols.offsets[start:end])
            start = end

    def _record(self, item: Record, slicer: _Slicer) -> None:
        """One decoded record into the current slice (or a dead letter if too large)."""
        limit = self.spec.max_record_bytes
        if item.size > limit:
            self._too_large_input(item, limit)
            return
        part = slicer.part
        row = (0, item.id, item.ts, None, item.elem)
        part.rows.append(row)
        part.lanes.append(item.lane)
        part.positional.append(item.positional)
        part.sizes.append(item.size)
        part.fingerprints.append(item.fingerprint)
        slicer.size += item.size
        if item.lane is not None:
            self.origins.add(item.id, item.lane, item.offset)

    def _letter(self, item: DeadLetter) -> int:
        """A dead letter made while decoding; what it weighs in the slice."""
        self.count(item.code, item.lost)
        self.guard.note(item.code, item.lost)
        self.body.dead(item)
        weight = min(item.payload_size(), self.spec.max_record_bytes)
        self.letter_bytes += weight
        return weight

    def _too_large_input(self, rec: Record, limit: int) -> None:
        """A source record over ``max_record_bytes`` is a dead letter, never processed.

        The letter carries the start of the value only; its origin says where the record is.
        """
        origin = f"{rec.lane}@{rec.offset}" if rec.lane is not None else self.spec.name
        reason = f"the record is {rec.size} bytes; {too_large(limit)}"
        stage = self.spec.source or self.spec.name
        letter = DeadLetter(
            rec.id, rec.ts, stage, reason, origin, None, describe(rec.elem), "too_large"
        )
        self.count("too_large", 1)
        self.guard.note("too_large", 1)
        self.body.dead(letter)

    def internal_rows(self, batches: Iterator[pa.RecordBatch]) -> Iterator[Part]:
        """Decode rows written by another stage (port = this stage's inbound index)."""
        keyed = [i.keyed for i in self.spec.inbound]
        decode = codec.decode
        for batch in batches:
            ids, tss, keys, values, ports = (batch.column(c).to_pylist() for c in ROW_COLUMNS)
            rows: list[InRow] = []
            for rid, ts, kb, value, port in zip(ids, tss, keys, values, ports, strict=True):
                if keyed[port]:
                    rows.append((port, rid, ts, kb, (decode(kb), decode(value))))
                else:
                    rows.append((port, rid, ts, None, decode(value)))
            yield Part(rows, [], [], _row_sizes(batch), [])


class _Slicer:
    """The slice of decoded source records being filled, and when it is full."""

    def __init__(self, max_rows: int, max_bytes: int) -> None:
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self.part = Part([], [], [], [], [])
        self.size = 0

    def full(self) -> Iterator[Part]:
        """The slice, handed on if it holds a slice's worth (records or bytes)."""
        if len(self.part.rows) >= self.max_rows or self.size >= self.max_bytes:
            yield from self.cut()

    def cut(self) -> Iterator[Part]:
        """Hand the slice on (even empty: the end of an input batch) and start a new one."""
        yield self.part
        self.part = Part([], [], [], [], [])
        self.size = 0

    def take(self, sizes: list[int], start: int) -> int:
        """How far from ``start`` the records of ``sizes`` fill this slice (at least one)."""
        room = self.max_rows - len(self.part.rows)
        end = min(len(sizes), start + max(room, 1))
        budget = self.max_bytes - self.size
        total = 0
        for i in range(start, end):
            total += sizes[i]
            if total >= budget:
                end = i + 1
                break
        self.size += total
        return end


def _row_sizes(batch: pa.RecordBatch) -> list[int]:
    """What each row another stage wrote weighs: its key and value bytes."""
    import pyarrow.compute as pc

    values = pc.fill_null(pc.binary_length(batch.column("value")), 0)
    keys = pc.fill_null(pc.binary_length(batch.column("key")), 0)
    return pc.add(values, keys).to_pylist()  # type: ignore[no-any-return]
