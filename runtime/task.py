"""Executor side: one task of one stage, start to end.

The loop is the same for every guarantee; a *guard* decides what it costs:

1. ``open``: outputs an earlier attempt of this task already committed are re-emitted
   (replayed from backup, never recomputed); if the attempt finished, that is all.
2. For each chunk of input: ``admit`` drops records already seen (duplicates, or records
   whose effect an earlier attempt committed); the rest run through the stage; ``commit``
   stores the chunk's outputs, its state changes and the seen-marks in one atomic step; if
   it reports conflicts (records another task committed meanwhile), the chunk is redone
   without them.
3. Outputs leave: rows for other stages go back to Spark; sink records are delivered
   (``undelivered`` filters what an earlier attempt delivered, ``delivered`` marks them).
4. ``finish`` commits the end-of-task outputs (combine results) and marks the task done.

The guard contract and the cheap guards are in :mod:`onceflow.runtime.guard`; the
exactly-once guard is :mod:`onceflow.dedup.guard`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from onceflow.connectors.base import TaskInfo
from onceflow.dedup.admission import Admission
from onceflow.dedup.errors import HorizonMovedError
from onceflow.kernel import codec
from onceflow.kernel.records import DeadLetter, InRow, Output, Record, TaskRef
from onceflow.runtime.body import StageBody, portable
from onceflow.runtime.faults import crashpoint
from onceflow.runtime.guard import GuardFactory
from onceflow.runtime.spec import StageSpec, TargetKind, TargetSpec

if TYPE_CHECKING:
    import pyarrow as pa

ROW_SCHEMA = "id binary, ts long, key binary, value binary, port int"
ROW_COLUMNS = ("id", "ts", "key", "value", "port")


class StageFunction:
    """The function handed to ``mapInArrow`` for one stage and one batch."""

    def __init__(
        self,
        spec: StageSpec,
        guards: GuardFactory,
        batch: int,
        metrics: Any = None,
    ) -> None:
        self.spec = spec
        self.guards = guards
        self.batch = batch
        self.metrics = metrics

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """Run the task over the partition's Arrow batches."""
        from pyspark import TaskContext

        ctx = TaskContext.get()
        partition = ctx.partitionId() if ctx is not None else 0
        attempt = ctx.attemptNumber() if ctx is not None else 0
        ref = TaskRef(self.spec.name, self.batch, partition, attempt, self.spec.sinks)
        task = TaskRun(self.spec, self.guards, ref)
        ok = False
        try:
            yield from task.run(batches)
            ok = True
        finally:
            task.close(ok)
            if self.metrics is not None and ok:
                self.metrics.add(task.counters)


class TaskRun:
    """The state of one running task."""

    def __init__(self, spec: StageSpec, guards: GuardFactory, task: TaskRef) -> None:
        self.spec = spec
        self.batch = task.batch
        self.partition = task.partition
        self.attempt = task.attempt
        self.guard = guards(task)
        self.body = StageBody(spec, self.guard.mode, task.batch, task.partition)
        self.writers: dict[int, Any] = {}
        self.counters: dict[str, int] = {}
        self.closed = False

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
            self.flush_sinks()
            return
        chunk_no = replay.next_chunk
        for rows in self.chunks(batches):
            outputs = self.process_chunk(chunk_no, rows)
            chunk_no += 1
            yield from self.emit(outputs)
        self.body.flush_end(self.guard.read_state)
        outputs = self.body.take()
        self.guard.finish(outputs)
        yield from self.emit(outputs)
        self.flush_sinks()
        crashpoint("task_end", self.spec.name, self.batch, self.partition, self.attempt)

    def process_chunk(self, chunk_no: int, rows: list[InRow]) -> list[Output]:
        """Admit, run and commit one chunk; redo it if GC moved the dedup floor meanwhile."""
        # Dead letters of records that failed to decode before the chunk was formed: they
        # leave with the chunk's first commit, whatever has to be redone.
        carried = self.body.take()
        while True:
            try:
                admission, outputs = self._attempt_chunk(chunk_no, rows, carried)
                break
            except HorizonMovedError:
                self.body.reset_chunk()
                self.count("horizon_redone")
        self.count("in", len(rows))
        if admission.duplicates:
            self.count("duplicates_dropped", admission.duplicates)
        if admission.replayed:
            self.count("replayed_inputs", len(admission.replayed))
        if admission.late:
            self.count("late", len(admission.late))
        return outputs

    def _attempt_chunk(
        self, chunk_no: int, rows: list[InRow], carried: list[Output]
    ) -> tuple[Admission, list[Output]]:
        """Admit, run and commit one chunk, redoing it without conflicting records.

        Dead letters of late records (and ``carried`` ones) are taken before the loop: a redo
        re-runs only the fresh records, and must not lose them.
        """
        admission = self.guard.admit(rows)
        for inbound, _rid, ts, kb, elem in admission.replayed:
            if kb is not None:
                self.body.touch(inbound, kb, elem[0], ts)
        for _inbound, rid, ts, _kb, elem in admission.late:
            reason = (
                f"event time {ts} is older than the dedup horizon: a copy of this record could "
                "no longer be recognised, so it is not processed"
            )
            self.body.dead(
                DeadLetter(rid, ts, self.spec.name, reason, rid.hex(), None, portable(elem))
            )
        fresh = admission.fresh
        before = carried + self.body.take()
        while True:
            self.body.run(fresh)
            outputs = before + self.body.take()
            updates = self.body.state_updates(self.guard.read_state)
            backup = outputs + self.body.partial_deltas() if self.guard.mode.ids else outputs
            crashpoint("before_commit", self.spec.name, self.batch, self.partition, self.attempt)
            conflicts = self.guard.commit(chunk_no, fresh, backup, updates)
            if not conflicts:
                break
            self.count("commit_conflicts", len(conflicts))
            self.count("duplicates_dropped", len(conflicts))
            self.body.reset_chunk()
            fresh = [r for r in fresh if r[1] not in conflicts]
        self.body.chunk_committed()
        crashpoint("after_commit", self.spec.name, self.batch, self.partition, self.attempt)
        return admission, outputs

    def chunks(self, batches: Iterator[pa.RecordBatch]) -> Iterator[list[InRow]]:
        """Input rows in chunks of the guard's size (whole Arrow batches when it is 0)."""
        rows = self.source_rows(batches) if self.spec.source else self.internal_rows(batches)
        size = self.guard.chunk_size
        if size <= 0:
            yield from rows
            return
        pending: list[InRow] = []
        for part in rows:
            pending.extend(part)
            while len(pending) >= size:
                yield pending[:size]
                pending = pending[size:]
        if pending:
            yield pending

    def source_rows(self, batches: Iterator[pa.RecordBatch]) -> Iterator[list[InRow]]:
        """Decode a source's raw rows; undecodable ones become dead letters."""
        decoder = self.spec.source_connector.decoder(self.spec.source, self.guard.mode.ids)
        for batch in batches:
            rows: list[InRow] = []
            for item in decoder(batch):
                if isinstance(item, Record):
                    rows.append((0, item.id, item.ts, None, item.elem))
                else:
                    assert isinstance(item, DeadLetter)
                    self.count("undecodable")
                    self.body.dead(item)
            yield rows

    def internal_rows(self, batches: Iterator[pa.RecordBatch]) -> Iterator[list[InRow]]:
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
            yield rows

    # -- outputs -------------------------------------------------------------------------

    def emit(self, outputs: list[Output]) -> Iterator[pa.RecordBatch]:
        """Deliver sink outputs and yield the rows other stages (or the driver) read."""
        if not outputs:
            return
        targets = self.spec.targets
        rows: list[Output] = []
        by_sink: dict[int, list[Output]] = {}
        for out in outputs:
            if targets[out.target].is_row:
                rows.append(out)
            else:
                by_sink.setdefault(out.target, []).append(out)
            self.count(f"out/{targets[out.target].name}")
        for index, outs in by_sink.items():
            self.deliver(targets[index], outs)
        if rows:
            yield to_arrow(rows)

    def deliver(self, target: TargetSpec, outputs: list[Output]) -> None:
        """Write sink records that no attempt delivered yet; mark them once acknowledged."""
        todo = self.guard.undelivered(target.index, outputs)
        skipped = len(outputs) - len(todo)
        if skipped:
            self.count("already_delivered", skipped)
        if not todo:
            return
        writer = self.writer(target)
        writer.write(decode_outputs(todo, target))
        if self.guard.mode.ids:
            writer.flush()
            crashpoint("after_sink_write", self.spec.name, self.batch, self.partition, self.attempt)
            self.guard.delivered(target.index, todo)

    def writer(self, target: TargetSpec) -> Any:
        """The task's writer for a sink target, opened on first use."""
        writer = self.writers.get(target.index)
        if writer is None:
            info = TaskInfo(
                self.spec.pipeline, target.name, self.batch, self.partition, self.attempt
            )
            writer = target.connector.open(info)
            self.writers[target.index] = writer
        return writer

    def flush_sinks(self) -> None:
        """Flush every writer (bounded runs deliver at the end of the task)."""
        for writer in self.writers.values():
            writer.flush()

    def close(self, ok: bool) -> None:
        """Close (or, after a failure, abort) writers and the guard; collect counters."""
        if self.closed:
            return
        self.closed = True
        for writer in self.writers.values():
            if ok:
                writer.close()
            else:
                writer.abort()
        for name, n in self.guard.close().items():
            self.count(name, n)
        if self.body.dead_count:
            self.count("dead_letters", self.body.dead_count)


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
