"""Executor side: one task of one stage, start to end.

The loop is the same for every guarantee; a *guard* decides what it costs:

1. ``open``: outputs an earlier attempt of this task already committed are re-emitted
   (replayed from backup, never recomputed); if the attempt finished, that is all.
2. For each chunk of input: ``admit`` drops records already seen (duplicates, or records
   whose effect an earlier attempt committed); the rest run through the stage; ``commit``
   stores the chunk's outputs, its state changes and the seen-marks in one atomic step; if
   it reports conflicts (records another task committed meanwhile), the chunk is redone
   without them.
3. Outputs leave: rows for other stages go back to Spark; sink records are held and
   delivered together (``undelivered`` filters what an earlier attempt delivered,
   ``delivered`` marks them) once a delivery's worth of a sink is held (the guard's
   ``delivery`` budget, by records and by bytes), and at the end of the task. Held records
   are already backed up: a crash before their delivery replays them from the backup, so
   holding them changes when they become visible, not whether.

Every unit is bounded by bytes as well as by count (:mod:`onceflow.kernel.limits`): chunks
(:mod:`~onceflow.runtime.chunking`, and again by what a chunk writes), deliveries, the Arrow
batches handed back to Spark and the slices a source's records are decoded in.
4. ``finish`` commits the end-of-task outputs (combine results) and marks the task done;
   what is still held is delivered.

The guard contract and the cheap guards are in :mod:`onceflow.runtime.guard`; the
exactly-once guard is :mod:`onceflow.dedup.guard`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from onceflow.connectors.base import (
    LaneProgress,
    PoisonInTransaction,
    Rejected,
    TaskInfo,
    TransactionalWriter,
    TransactionBroken,
)
from onceflow.connectors.errors import ConnectorError
from onceflow.dedup.admission import Admission
from onceflow.dedup.commit import FloorRaised
from onceflow.dedup.delivery import NO_MARKER
from onceflow.dedup.errors import FencedError
from onceflow.kernel import codec, ids
from onceflow.kernel.limits import SOURCE_SLICE_RECORDS, Budget, outputs_bytes, split_outputs
from onceflow.kernel.records import DeadLetter, InRow, Output, Record, StateWrite, TaskRef
from onceflow.runtime.body import StageBody, StageFailure, describe, portable, too_large
from onceflow.runtime.chunking import Chunker, Part
from onceflow.runtime.errors import TASK_FAILURE_MARK, RuntimeFailure, TaskFailure
from onceflow.runtime.faults import CrashPoint, crashpoint
from onceflow.runtime.guard import GuardFactory
from onceflow.runtime.metrics import dead_letter_counter
from onceflow.runtime.spec import StageSpec, TargetKind, TargetSpec

if TYPE_CHECKING:
    import pyarrow as pa

MAX_FAILURE_CHARS = 600
MAX_ORIGINS = 50_000  # source records whose origin a task remembers for error messages
# Event times below this many ms (September 2001) are taken to be seconds by mistake.
SECONDS_NOT_MS = 1_000_000_000_000
ROW_SCHEMA = "id binary, ts long, key binary, value binary, port int"
ROW_COLUMNS = ("id", "ts", "key", "value", "port")


# Spark local property holding a streaming micro-batch's guard parameters (JSON), read by
# stage functions made once per run (``batch=None``, see onceflow.runtime.spark.StreamCompiler).
BATCH_PROPERTY = "onceflow.batch"
BATCH_ID_PROPERTY = "onceflow.batch.id"


class StageFunction:
    """The function handed to ``mapInArrow`` for one stage (and one batch, or every batch).

    With ``batch=None`` the micro-batch and its guard parameters are read in the task from
    Spark local properties the driver set for the batch's job (:data:`BATCH_PROPERTY`), so
    one pickled function serves every micro-batch of a streaming run.
    """

    def __init__(
        self,
        spec: StageSpec,
        guards: GuardFactory,
        batch: int | None,
        metrics: Any = None,
        partitions: int | None = None,
    ) -> None:
        self.spec = spec
        self.guards = guards
        self.batch = batch
        self.metrics = metrics
        self.partitions = partitions  # an exchange stage's partition count

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """Run the task over the partition's Arrow batches.

        The partition is the task's: Spark's partition id, which inside a union is the
        union's index. An exchange stage's keyed state is kept per partition, so its own
        index is taken back modulo its partition count (the compiler puts such stages at
        multiples of it, see :mod:`onceflow.runtime.spark`).
        """
        from pyspark import TaskContext

        ctx = TaskContext.get()
        partition = ctx.partitionId() if ctx is not None else 0
        if self.partitions:
            partition %= self.partitions
        attempt = ctx.attemptNumber() if ctx is not None else 0
        attempt_id = ctx.taskAttemptId() if ctx is not None else 0
        batch, guards = self._batch(ctx)
        ref = TaskRef(self.spec.name, batch, partition, attempt, self.spec.sinks, attempt_id)
        task = TaskRun(self.spec, guards, ref)
        ok = False
        try:
            yield from task.run(batches)
            ok = True
        except FencedError:
            raise
        except Exception as exc:
            raise TaskFailure(task.failure_line(exc)) from exc
        finally:
            task.close(ok)
            if self.metrics is not None and ok:
                self.metrics.add(task.counters)

    def _batch(self, ctx: Any) -> tuple[int, GuardFactory]:
        """The micro-batch and guard factory of this task (see the class docstring)."""
        if self.batch is not None:
            return self.batch, self.guards
        batch = ctx.getLocalProperty(BATCH_ID_PROPERTY) if ctx is not None else None
        text = ctx.getLocalProperty(BATCH_PROPERTY) if ctx is not None else None
        if batch is None or text is None:
            msg = (
                f"stage {self.spec.name!r} ran without its micro-batch's parameters "
                f"(Spark local property {BATCH_PROPERTY!r}); this is a runner bug"
            )
            raise RuntimeFailure(msg)
        return int(batch), self.guards.with_batch_json(text)  # type: ignore[attr-defined]


class TaskRun:
    """The state of one running task."""

    def __init__(self, spec: StageSpec, guards: GuardFactory, task: TaskRef) -> None:
        self.spec = spec
        self.batch = task.batch
        self.partition = task.partition
        self.attempt = task.attempt
        self.attempt_id = task.attempt_id
        self.guard = guards(task)
        self.body = StageBody(
            spec,
            self.guard.mode,
            task.batch,
            task.partition,
            self.guard.watermark,
            self.guard.batch_time_ms,
        )
        self.writers: dict[int, Any] = {}
        self.held: dict[int, list[Output]] = {}  # sink target -> outputs not yet delivered
        self.held_bytes: dict[int, int] = {}  # sink target -> what its held outputs weigh
        self.letter_bytes = 0  # payload of dead letters made while decoding, not yet committed
        self.counters: dict[str, int] = {}
        self.closed = False
        self.origins: dict[bytes, str] = {}  # source records of the current input batch
        self.body.origins = self.origins
        self.progress: dict[str, int] = {}  # lane heartbeats not yet sent with a chunk
        self.noted: dict[int, str] = {}  # sink target -> writer identity recorded in Redis
        self.prints: dict[int, int] = {}  # id() of a row of the chunk -> its content fingerprint

    def failure_line(self, exc: BaseException) -> str:
        """One line for a person: which task failed, on which record, and why."""
        where = f"stage {self.spec.name!r} (batch {self.batch}, partition {self.partition})"
        text = " ".join(str(exc).split())[:MAX_FAILURE_CHARS]
        line = f"{TASK_FAILURE_MARK} {where}: {type(exc).__name__}: {text}"
        if isinstance(exc, ConnectorError):  # reading or writing failed, not a record
            return line
        parent = self.body.cursor.parent
        origin = self.origins.get(parent)
        if origin is not None:
            line += f" [input record {origin}]"
        elif parent:
            line += f" [record {parent.hex()}]"
        return line

    def crash(self, point: CrashPoint) -> None:
        """A crashpoint of this task (free unless a test armed it: see :mod:`.faults`)."""
        crashpoint(point, self.spec.name, self.batch, self.partition, self.attempt)

    def count(self, name: str, n: int = 1) -> None:
        """Add to a counter named ``stage/name``."""
        key = f"{self.spec.name}/{name}"
        self.counters[key] = self.counters.get(key, 0) + n

    # -- the loop ------------------------------------------------------------------------

    def run(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """Steps 1-4 of the module docstring."""
        replay = self.guard.open()
        deltas = [o for o in replay.outputs if o.target < 0]
        sent = [o for o in replay.outputs if o.target >= 0]
        if deltas and not replay.done:
            self.body.seed_partials(deltas)
        if sent:
            self.count("replayed_outputs", len(sent))
            yield from self.emit(sent)
        if replay.done:
            for _ in batches:  # the input is already reflected in the backup
                pass
            yield from self.release()
            yield from self.flush_sinks()
            return
        chunk_no = replay.next_chunk
        for rows, lanes, positional, prints in self.chunks(batches):
            outputs, chunk_no = self.process_chunk(chunk_no, rows, lanes, positional, prints)
            yield from self.emit(outputs)
        self.close_counts()
        changes = self.body.flush_end(self.guard.read_state, self.guard.due_timers)
        outputs = self.finish(chunk_no, self.body.take(), changes, {o.id for o in sent})
        yield from self.emit(outputs)
        yield from self.release()
        yield from self.flush_sinks()
        self.crash(CrashPoint.TASK_END)

    def process_chunk(
        self,
        chunk_no: int,
        rows: list[InRow],
        lanes: Mapping[str, int],
        positional: Sequence[bool] = (),
        prints: Sequence[int] = (),
    ) -> tuple[list[Output], int]:
        """Admit, run and commit one chunk; return its outputs and the next chunk's number.

        ``lanes``: the newest admissible event time per source lane among the chunk's rows;
        ``positional``: per row, whether its ID is a positional one (empty: none is, see
        :class:`~onceflow.kernel.records.Record`); ``prints``: per row, its content
        fingerprint (empty: none known). A chunk whose writes pass the chunk's bytes is
        committed in parts, each numbered as a chunk of its own.
        """
        self.prints = {id(row): fp for row, fp in zip(rows, prints, strict=True)} if prints else {}
        # Dead letters of records that failed to decode before the chunk was formed: they
        # leave with the chunk's first commit, whatever has to be redone.
        carried = self.body.take()
        self.letter_bytes = 0
        admission, outputs, chunk_no = self._attempt_chunk(
            chunk_no, rows, carried, lanes, positional, prints
        )
        self.count("in", len(rows))
        if admission.duplicates:
            self.count("duplicates_dropped", admission.duplicates)
        if admission.replayed:
            self.count("replayed_inputs", len(admission.replayed))
        if admission.late:
            self.count("late", len(admission.late))
        if admission.ahead:
            self.count("ahead", len(admission.ahead))
        if admission.conflicts:
            self.count("id_conflicts", len(admission.conflicts))
        return outputs, chunk_no

    def finish(
        self,
        chunk_no: int,
        outputs: list[Output],
        changes: Mapping[str, StateWrite],
        replayed: Collection[bytes],
    ) -> list[Output]:
        """Commit the end-of-task outputs with their state changes, mark the task done.

        Outputs beyond one chunk's bytes go first, in commits of their own numbered on as
        chunks; the last part goes with the state changes and the done marker (the guard's
        ``finish``). An attempt that died between those commits left some in its backup: they
        were replayed when this one opened (``replayed``: their IDs), and as end-of-task
        outputs are the same again (their IDs derive from keys, windows and the batch, their
        values from state only the done step changes) they are neither stored nor sent twice.
        Returns the outputs to send on.
        """
        if replayed:
            outputs = [o for o in outputs if o.id not in replayed]
        parts = list(split_outputs(outputs, Budget(0, self.guard.chunk_bytes))) or [[]]
        for part in parts[:-1]:
            self.guard.commit(chunk_no, [], part, {}, {})
            chunk_no += 1
            self.crash(CrashPoint.AFTER_COMMIT)
        self.crash(CrashPoint.BEFORE_FINISH)
        self.guard.finish(parts[-1], changes)
        self.crash(CrashPoint.AFTER_FINISH)
        return outputs

    def close_counts(self) -> None:
        """Counters only known at the end of the task."""
        closed = self.body.closed_parts()
        if closed:
            self.count("window_closed_parts", closed)
            self.guard.note("window_closed_parts", closed)

    def _attempt_chunk(
        self,
        chunk_no: int,
        rows: list[InRow],
        carried: list[Output],
        lanes: Mapping[str, int],
        positional: Sequence[bool] = (),
        prints: Sequence[int] = (),
    ) -> tuple[Admission, list[Output], int]:
        """Admit a chunk, then run and commit it (in parts when its writes pass the budget).

        Dead letters of late, ahead and ID-conflicting records (and ``carried`` ones) are
        taken before the loop: they leave with the first part's commit, whatever has to be
        redone. Returns the admission, the outputs committed and the next chunk's number.
        """
        admission = self.guard.admit(rows, positional, prints)
        for inbound, _rid, ts, kb, elem in admission.replayed:
            if kb is not None:
                self.body.touch(inbound, kb, elem[0], ts)
        for row in admission.late:
            self._refuse(row, late_reason(row[2]), "late")
        for row in admission.ahead:
            self._refuse(row, ahead_reason(row[2], self.guard.limit_ms), "ahead")
        for row in admission.conflicts:
            self._refuse_conflict(row)
        before = carried + self.body.take()
        todo = admission.fresh
        outputs: list[Output] = []
        while True:
            committed, todo = self._commit_part(chunk_no, todo, before, lanes, admission.unmarked)
            outputs += committed
            chunk_no += 1
            if not todo:
                return admission, outputs, chunk_no
            before = []

    def _commit_part(
        self,
        chunk_no: int,
        fresh: list[InRow],
        before: list[Output],
        lanes: Mapping[str, int],
        unmarked: Collection[bytes],
    ) -> tuple[list[Output], list[InRow]]:
        """Run and commit the first rows of ``fresh`` whose writes fit the chunk's bytes.

        Returns the outputs committed and the rows left for the next part (the lanes go with
        the last part). A commit that conflicts (records another task committed meanwhile) is
        redone without them. A record whose outputs alone pass the budget becomes a dead
        letter (``too_large``) and is committed as an input with the letter as its only
        output, so that a retry replays it rather than run it again. A commit refused because
        GC raised its floor meanwhile (:class:`FloorRaised`) is redone without the records
        the floor makes late, which become dead letters as admission's late ones do.
        """
        counts = self.body.counts()
        rest: list[InRow] = []
        refused: dict[bytes, DeadLetter] = {}
        while True:
            self.body.run([r for r in fresh if r[1] not in refused] if refused else fresh)
            for letter in refused.values():
                self.body.dead(letter)
            updates = self.body.state_updates(self.guard.read_state)  # may fire late panes
            made = self.body.take()
            deltas = self.body.partial_deltas() if self.guard.mode.ids else []
            cut = self._cut_at(fresh, before, made + deltas, updates, refused)
            if cut is not None:  # too much for one commit: fewer rows, or the one refused
                self.body.reset_chunk()
                self.body.restore_counts(counts)
                if cut == 0:
                    refused[fresh[0][1]] = self._too_large_letter(fresh[0], made + deltas)
                else:
                    fresh, rest = fresh[:cut], fresh[cut:] + rest
                continue
            outputs = before + made
            self.crash(CrashPoint.BEFORE_COMMIT)
            try:
                conflicts = self.guard.commit(
                    chunk_no, fresh, outputs + deltas, updates, {} if rest else lanes, unmarked
                )
            except FloorRaised as raised:
                self.body.reset_chunk()
                self.body.restore_counts(counts)
                fresh, letters = self._late_after_gc(raised.floor_ms, fresh, unmarked)
                before = before + letters
                counts = self.body.counts()
                continue
            if not conflicts:
                break
            other = self.guard.conflicting_content()  # another record's ID, not a copy
            self.count("commit_conflicts", len(conflicts))
            self.count("duplicates_dropped", len(conflicts) - len(other))
            self.body.reset_chunk()
            self.body.restore_counts(counts)  # the redo counts its dead letters anew
            if other:
                before = before + self._conflict_letters([r for r in fresh if r[1] in other])
                counts = self.body.counts()
            fresh = [r for r in fresh if r[1] not in conflicts]
            refused = {rid: letter for rid, letter in refused.items() if rid not in conflicts}
        self.body.chunk_committed()
        self.crash(CrashPoint.AFTER_COMMIT)
        return outputs, rest

    def _conflict_letters(self, rows: list[InRow]) -> list[Output]:
        """Dead letters of rows another task committed an ID of, with other content."""
        for row in rows:
            self._refuse_conflict(row)
        self.count("id_conflicts", len(rows))
        return self.body.take()

    def _late_after_gc(
        self, floor_ms: int, fresh: list[InRow], unmarked: Collection[bytes]
    ) -> tuple[list[InRow], list[Output]]:
        """GC deleted seen-IDs below ``floor_ms`` while the batch ran: those records are late.

        Their copies' seen-marks may be gone, so they cannot be told from copies (rows without
        seen-marks, ``unmarked`` position IDs, need none). Returns the rows left and the late
        ones' dead letters.
        """
        self.guard.raise_floor(floor_ms)
        late = [r for r in fresh if r[1] not in unmarked and self.guard.is_late(r[2])]
        for row in late:
            self._refuse(row, late_reason(row[2]), "late")
        self.count("gc_floor_redos")
        self.count("late", len(late))
        self.guard.note("late", len(late))
        gone = {r[1] for r in late}
        return [r for r in fresh if r[1] not in gone], self.body.take()

    def _cut_at(
        self,
        fresh: list[InRow],
        before: list[Output],
        written: list[Output],
        updates: Mapping[str, StateWrite],
        refused: Mapping[bytes, DeadLetter],
    ) -> int | None:
        """How many rows of ``fresh`` to keep so that the commit fits (None: all of them).

        0 means the first row alone writes more than a commit may carry, a record too large to
        process. Otherwise the estimate keeps the share of rows the budget has room for; if
        that is still too much the next run cuts again.
        """
        budget = self.guard.chunk_bytes
        if budget <= 0 or not fresh:
            return None
        out = outputs_bytes(written)
        state = _state_bytes(updates)
        carried = outputs_bytes(before) if before else 0
        if out + state + carried <= budget:
            return None
        if len(fresh) > 1:
            room = max(budget - carried, 0) / (out + state)
            return min(len(fresh) - 1, max(1, int(len(fresh) * room)))
        if out > budget and fresh[0][1] not in refused:
            return 0
        return None  # one row, within the budget but for carried letters or state: commit it

    def _too_large_letter(self, row: InRow, written: list[Output]) -> DeadLetter:
        """The dead letter of a record whose outputs together pass the chunk's bytes."""
        reason = (
            f"its outputs take {outputs_bytes(written)} bytes together, more than one commit "
            f"may carry ({self.guard.chunk_bytes} bytes, DedupConfig.chunk_bytes): it is not "
            "processed; raise chunk_bytes, or make the function's outputs smaller"
        )
        if self.spec.on_error == "fail":
            raise StageFailure(reason)
        self.count("too_large")
        return self._letter(row, reason, "too_large")

    def _refuse(self, row: InRow, reason: str, code: str) -> None:
        """A record admission turned away becomes a dead letter (it is counted, not lost)."""
        self.body.dead(self._letter(row, reason, code))

    def _refuse_conflict(self, row: InRow) -> None:
        """A record under an ID another record with other content has: a dead letter.

        Its letter's ID derives from the ID and the content, so that several such records
        (one ID header copied onto each) make several letters, and copies of one make one.
        """
        fp = self.prints.get(id(row), 0)
        letter = self._letter(row, id_conflict_reason(row[1]), "id_conflict")
        self.body.dead(replace(letter, id=ids.from_user_key(row[1] + fp.to_bytes(4, "big"))))

    def _letter(self, row: InRow, reason: str, code: str) -> DeadLetter:
        """A dead letter for an input row (where it was read, its value as JSON if it can)."""
        _inbound, rid, ts, _kb, elem = row
        origin = self.origins.get(rid) or (rid.hex() if rid else self.spec.name)
        return DeadLetter(rid, ts, self.spec.name, reason, origin, None, portable(elem), code)

    def chunks(
        self, batches: Iterator[pa.RecordBatch]
    ) -> Iterator[tuple[list[InRow], dict[str, int], list[bool], list[int]]]:
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
                yield chunk.rows, marks, chunk.positional, chunk.prints
            if self.letter_bytes >= self.guard.chunk_bytes or (whole_batches and not part.rows):
                yield [], self._lane_marks([], []), [], []
        for chunk in chunker.flush():
            marks = self._lane_marks(chunk.rows, chunk.lanes)
            yield chunk.rows, marks, chunk.positional, chunk.prints
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
        for row, lane in zip(rows, lanes, strict=True):
            ts = row[2]
            if lane is None or (limit is not None and ts > limit):
                continue
            if ts > marks.get(lane, ts - 1):
                marks[lane] = ts
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
        ``max_record_bytes`` (:meth:`_too_large_input`), become dead letters.
        """
        decoder = self.spec.source_connector.decoder(self.spec.source, self.guard.mode.ids)
        origins = self.origins
        limit = self.spec.max_record_bytes
        max_rows, max_bytes = SOURCE_SLICE_RECORDS, self.guard.chunk_bytes
        part = Part([], [], [], [], [])
        rows, lanes, positional, sizes, prints = part
        size = 0
        for batch in batches:
            for item in decoder(batch):
                if len(rows) >= max_rows or size >= max_bytes:
                    yield part
                    part = Part([], [], [], [], [])
                    rows, lanes, positional, sizes, prints = part
                    size = 0
                    if len(origins) > MAX_ORIGINS:
                        origins.clear()
                if isinstance(item, Record):
                    if item.size > limit:
                        self._too_large_input(item, limit)
                        continue
                    rows.append((0, item.id, item.ts, None, item.elem))
                    lanes.append(item.lane)
                    positional.append(item.positional)
                    sizes.append(item.size)
                    prints.append(item.fingerprint)
                    size += item.size
                    if item.lane is not None:
                        origins[item.id] = f"{item.lane}@{item.offset}"
                elif isinstance(item, LaneProgress):
                    self._heartbeat(item)
                else:
                    assert isinstance(item, DeadLetter)
                    self.count(item.code, item.lost)
                    self.guard.note(item.code, item.lost)
                    self.body.dead(item)
                    weight = min(item.payload_size(), limit)
                    self.letter_bytes += weight
                    size += weight
            yield part
            part = Part([], [], [], [], [])
            rows, lanes, positional, sizes, prints = part
            size = 0
            if len(origins) > MAX_ORIGINS:
                origins.clear()

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
        self.count("too_large")
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

    # -- outputs -------------------------------------------------------------------------

    def emit(self, outputs: list[Output]) -> Iterator[pa.RecordBatch]:
        """Yield the rows other stages (or the driver) read; hold sink outputs.

        Rows go back to Spark in Arrow batches of at most a chunk's bytes (a replay hands over
        every chunk an earlier attempt committed at once). A sink's held outputs are delivered
        once they fill the guard's ``delivery`` budget (and the rest by :meth:`release` at the
        end of the task).
        """
        if not outputs:
            return
        targets = self.spec.targets
        rows: list[Output] = []
        new: dict[int, list[Output]] = {}
        for out in outputs:
            if targets[out.target].is_row:
                rows.append(out)
            else:
                new.setdefault(out.target, []).append(out)
            self.count(f"out/{targets[out.target].name}")
        for index, outs in new.items():
            self.held.setdefault(index, []).extend(outs)
            self.held_bytes[index] = self.held_bytes.get(index, 0) + outputs_bytes(outs)
        budget = self.guard.delivery
        full = [i for i, outs in self.held.items() if budget.full(len(outs), self.held_bytes[i])]
        rows += self._deliver_held(full)
        yield from self.arrow_batches(rows)

    def arrow_batches(self, rows: list[Output]) -> Iterator[pa.RecordBatch]:
        """Rows as Arrow batches of at most a chunk's bytes (one oversized row alone)."""
        if rows:
            for part in split_outputs(rows, Budget(0, self.guard.chunk_bytes)):
                yield to_arrow(part)

    def release(self) -> Iterator[pa.RecordBatch]:
        """Deliver every sink output still held; yield dead letters that leave as rows."""
        yield from self.arrow_batches(self._deliver_held(list(self.held)))

    def _deliver_held(self, indexes: list[int]) -> list[Output]:
        """Deliver the held outputs of these sink targets; return dead letters as rows."""
        refused: list[Output] = []
        for index in indexes:
            outs = self.held.pop(index)
            self.held_bytes.pop(index, None)
            refused += self.deliver_all(self.spec.targets[index], outs)
        return self.deliver_dead_letters(refused)

    def deliver_all(self, target: TargetSpec, outputs: list[Output]) -> list[Output]:
        """:meth:`deliver` in deliveries of at most the guard's ``delivery`` budget each."""
        refused: list[Output] = []
        for part in split_outputs(outputs, self.guard.delivery):
            refused += self.deliver(target, part)
        return refused

    def deliver(self, target: TargetSpec, outputs: list[Output]) -> list[Output]:
        """Write sink records that no attempt delivered yet; mark them once visible.

        Returns dead letters (encoded, with IDs derived from the records') for records the
        sink refused for good; a retry refuses them again and derives the same letters.
        With IDs on, the delivery is remembered as pending in Redis before it becomes
        visible (see :mod:`onceflow.dedup.delivery`); a transactional sink commits only then.
        """
        writer = self.writer(target)
        if not self.guard.mode.ids:  # no IDs to tell records apart (they may be empty)
            return self.refused_letters(target, writer.write(decode_outputs(outputs, target)))
        todo = self.guard.undelivered(target.index, _first_of_each_id(outputs))
        skipped = len(outputs) - len(todo)
        if skipped:
            self.count("already_delivered", skipped)
        if not todo:
            return []
        records = decode_outputs(todo, target)
        if isinstance(writer, TransactionalWriter):
            rejected = self._deliver_in_transaction(target, writer, todo, records)
        else:
            self.guard.prepare_delivery(target.index, NO_MARKER, todo)
            rejected = writer.write(records)
            rejected += writer.flush()
            self.crash(CrashPoint.AFTER_SINK_WRITE)
        # Refused records are not marked: their dead letters are not durable yet, and a
        # retry that finds them unmarked refuses them again and makes the same letters.
        self.guard.delivered(target.index, accepted(todo, records, rejected))
        return self.refused_letters(target, rejected)

    def _deliver_in_transaction(
        self,
        target: TargetSpec,
        writer: TransactionalWriter,
        todo: list[Output],
        records: list[Record],
    ) -> list[Rejected]:
        """Write, prepare, remember as pending, commit: the records become visible once.

        A transaction its system broke (:class:`TransactionBroken`: Kafka went away under
        it) is recovered once Redis confirms this attempt still owns the sink partition
        (``note_writer`` is fenced: a zombie attempt stops there): the writer ends it and
        says whether it committed; if not, the records go again in a new transaction, under
        a new pending delivery.
        """
        rejected: list[Rejected] = []
        self.guard.note_writer(target.index, writer.identity)  # before it begins
        self.noted[target.index] = writer.identity
        sending = records
        while True:
            try:
                sending = self._commit_transaction(target, writer, todo, records, sending, rejected)
                break
            except TransactionBroken:
                self.guard.note_writer(target.index, writer.identity)
                if writer.recover():
                    break
                self.count("sink_transactions_redone")
        self.crash(CrashPoint.AFTER_SINK_COMMIT)
        self.noted.pop(target.index, None)  # guard.delivered() deletes the record
        return rejected

    def _commit_transaction(
        self,
        target: TargetSpec,
        writer: TransactionalWriter,
        todo: list[Output],
        records: list[Record],
        sending: list[Record],
        rejected: list[Rejected],
    ) -> list[Record]:
        """One transaction of ``sending``: refused records join ``rejected``; what was sent.

        The pending delivery names what becomes visible: a recovery marks exactly that.
        """
        while True:
            refused = writer.write(sending)
            rejected += refused
            if refused:  # refused before sending: not again in a redone transaction
                sending = _without(sending, refused)
            self.crash(CrashPoint.IN_SINK_TRANSACTION)
            try:
                marker = writer.prepare()
                break
            except PoisonInTransaction as poison:  # the transaction was aborted: again without
                rejected += poison.rejected
                sending = _without(sending, poison.rejected)
        self.guard.prepare_delivery(target.index, marker, accepted(todo, records, rejected))
        self.crash(CrashPoint.AFTER_SINK_WRITE)
        writer.commit()
        return sending

    def refused_letters(self, target: TargetSpec, rejected: list[Rejected]) -> list[Output]:
        """Dead letters for records a sink refused."""
        if not rejected:
            return []
        self.count("refused_by_sink", len(rejected))
        for rec, reason in rejected:
            origin = f"record {rec.id.hex()} for sink {target.name}" if rec.id else target.name
            self.body.dead(
                DeadLetter(
                    rec.id, rec.ts, target.name, reason, origin, None, portable(rec.elem), "refused"
                )
            )
        return self.body.take()

    def deliver_dead_letters(self, letters: list[Output]) -> list[Output]:
        """Send dead letters made while delivering; return those that leave as rows."""
        if not letters:
            return []
        dead = self.spec.targets[self.spec.dead_target]
        if dead.is_row:
            return letters
        refused = self.deliver_all(dead, letters)
        if refused:
            msg = f"the dead-letter sink {dead.connector.describe()} refused a dead letter"
            raise ConnectorError(msg)
        return []

    def writer(self, target: TargetSpec) -> Any:
        """The task's writer for a sink target, opened on first use.

        On opening, what earlier attempts left is dealt with first: transactional writers
        recorded for the partition are settled (their open transactions ended), then a
        delivery left pending is resolved: marked if it became visible, dropped (and counted
        as possible copies, for a plain sink) if not.
        """
        writer = self.writers.get(target.index)
        if writer is None:
            info = TaskInfo(
                self.spec.pipeline,
                target.name,
                self.batch,
                self.partition,
                self.attempt,
                self.guard.mode.ids,
                self.attempt_id,
                target.keyed,
            )
            writer = target.connector.open(info)
            self.writers[target.index] = writer
            left = self.guard.sink_state(target.index)
            transactional = isinstance(writer, TransactionalWriter)
            if left.writers and transactional:
                writer.settle(left.writers)
                self.count("writers_settled", len(left.writers))
            if left.pending is not None:
                happened = (
                    writer.committed(left.pending.marker)
                    if left.pending.transactional and transactional
                    else False
                )
                self.guard.resolve_pending(target.index, left.pending, happened)
                self.count("deliveries_recovered")
        return writer

    def flush_sinks(self) -> Iterator[pa.RecordBatch]:
        """Flush every writer (bounded runs deliver at the end of the task).

        Records refused only now (a bounded run flushes at the end) become dead letters.
        """
        letters: list[Output] = []
        for index, writer in list(self.writers.items()):
            letters += self.refused_letters(self.spec.targets[index], writer.flush())
        rows = self.deliver_dead_letters(letters)
        for writer in self.writers.values():
            writer.flush()
        yield from self.arrow_batches(rows)

    def close(self, ok: bool) -> None:
        """Close (or, after a failure, abort) writers and the guard; collect counters."""
        if self.closed:
            return
        self.closed = True
        for index, writer in self.writers.items():
            if ok:
                writer.close()
                for name, n in writer.counts().items():
                    self.count(f"{name}/{self.spec.targets[index].name}", n)
            else:
                writer.abort()
                self._forget_writer(index, writer)
        for name, n in self.guard.close().items():
            self.count(name, n)
        if self.body.dead_count:
            self.count("dead_letters", self.body.dead_count)
        for code, n in self.body.dead_codes.items():
            self.count(dead_letter_counter(code), n)

    def _forget_writer(self, index: int, writer: Any) -> None:
        """After a failure: forget a recorded writer whose transaction aborted cleanly.

        Then the next attempt need not settle it (registering the partition's id anew, which
        costs a round trip and fences the producer later tasks here would reuse). Best
        effort: left recorded, it is settled instead.
        """
        identity = self.noted.pop(index, None)
        if identity is None or not writer.aborted_cleanly():
            return
        with contextlib.suppress(Exception):
            self.guard.note_writer(index, identity, begins=False)


def id_conflict_reason(rid: bytes) -> str:
    """Why a record under an ID another record with other content has is not processed."""
    return (
        f"record ID {rid.hex()} was already used by a record with other content (key and "
        "value bytes): no copy, another record. An app between two pipelines may have copied "
        "one onceflow-id header onto several records, or the source's id function names an "
        "entity (an order) rather than an event; give each event its own ID (KafkaSource(id="
        "...) wins over the header)"
    )


def late_reason(ts: int) -> str:
    """Why a record older than the dedup horizon is not processed."""
    hint = ""
    if 0 < ts < SECONDS_NOT_MS and ts * 1000 > SECONDS_NOT_MS:
        hint = " (it looks like seconds, not milliseconds: fix the timestamp function)"
    return (
        f"event time {ts} is older than the dedup horizon: a copy of this record could no "
        f"longer be recognised, so it is not processed{hint}"
    )


def ahead_reason(ts: int, limit: int | None) -> str:
    """Why a record too far ahead of the clock is not processed."""
    hint = ""
    if limit is not None and ts > limit * 100:
        hint = " (it looks like microseconds or nanoseconds, not milliseconds)"
    return (
        f"event time {ts} is further ahead of the clock than the pipeline allows (newest "
        f"admitted: {limit}): a producer's clock is wrong{hint}; it is not processed, so it "
        "cannot move the watermark (raise EventTime.max_ahead if such times are real)"
    )


def accepted(todo: list[Output], records: list[Record], rejected: list[Rejected]) -> list[Output]:
    """The outputs whose records (``records[i]`` is ``todo[i]``'s) the sink did not refuse."""
    if not rejected:
        return todo
    refused = {id(rec) for rec, _ in rejected}
    return [o for o, rec in zip(todo, records, strict=True) if id(rec) not in refused]


def _without(records: list[Record], rejected: list[Rejected]) -> list[Record]:
    """``records`` less the rejected ones (by identity: two records may be equal)."""
    bad = {id(rec) for rec, _ in rejected}
    return [r for r in records if id(r) not in bad]


def decode_outputs(outputs: Iterable[Output], target: TargetSpec) -> list[Record]:
    """Sink records back from their encoded form (sinks write elements, not bytes)."""
    decode = codec.decode
    if target.keyed and target.kind is not TargetKind.DEAD:
        return [Record(o.id, o.ts, (decode(o.key), decode(o.value))) for o in outputs]  # type: ignore[arg-type]
    return [Record(o.id, o.ts, decode(o.value)) for o in outputs]


def to_arrow(outputs: Sequence[Output]) -> pa.RecordBatch:
    """Output rows as an Arrow batch of :data:`ROW_SCHEMA`."""
    import pyarrow as pa

    cols = list(zip(*outputs, strict=True))
    return pa.RecordBatch.from_arrays(
        [
            pa.array(cols[1], pa.binary()),
            pa.array(cols[2], pa.int64()),
            pa.array(cols[3], pa.binary()),
            pa.array(cols[4], pa.binary()),
            pa.array(cols[0], pa.int32()),
        ],
        names=list(ROW_COLUMNS),
    )


def _first_of_each_id(outputs: list[Output]) -> list[Output]:
    """Outputs without repeated IDs: one ID is one record, however many copies a task holds.

    A retry can hold two: a dead letter replayed from the backup of the attempt that died
    before delivering it, and the same letter made again from an input that was never
    admitted (an undecodable, late or ahead record).
    """
    first: dict[bytes, Output] = {}
    for o in outputs:
        first.setdefault(o.id, o)
    return outputs if len(first) == len(outputs) else list(first.values())


def _row_sizes(batch: pa.RecordBatch) -> list[int]:
    """What each row another stage wrote weighs: its key and value bytes."""
    import pyarrow.compute as pc

    values = pc.fill_null(pc.binary_length(batch.column("value")), 0)
    keys = pc.fill_null(pc.binary_length(batch.column("key")), 0)
    return pc.add(values, keys).to_pylist()  # type: ignore[no-any-return]


def _state_bytes(updates: Mapping[str, StateWrite]) -> int:
    """What a chunk's keyed-state writes weigh in its commit (keys, values and timers)."""
    total = 0
    for write in updates.values():
        values = write.values
        total += sum(map(len, values)) + sum(map(len, filter(None, values.values())))
        for timers in write.timers.values():
            total += sum(map(len, timers)) + 8 * len(timers)
    return total
