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

:class:`NoGuard` makes all of this free for bounded runs; the Redis-backed guards live in
``dedup``.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from graph_optimizer.compile.body import InRow, Mode, StageBody, portable
from graph_optimizer.compile.spec import StageSpec, TargetKind, TargetSpec
from onceflow import codec
from onceflow.records import DeadLetter, Output, Record

if TYPE_CHECKING:
    import pyarrow as pa

ROW_SCHEMA = "id binary, ts long, key binary, value binary, port int"
ROW_COLUMNS = ("id", "ts", "key", "value", "port")


class HorizonMovedError(Exception):
    """A guard refused a commit: GC raised the dedup floor after the chunk was admitted.

    The task redoes the chunk, and records now below the floor become late dead letters.
    """


@dataclass
class Admission:
    """What ``admit`` decided for a chunk."""

    fresh: list[InRow]
    replayed: list[InRow] = field(default_factory=list)  # effect committed by an earlier attempt
    duplicates: int = 0
    late: list[InRow] = field(default_factory=list)  # older than the dedup horizon


@dataclass
class Replay:
    """What an earlier attempt of the same task committed."""

    outputs: list[Output] = field(default_factory=list)
    done: bool = False
    next_chunk: int = 0


class Guard(Protocol):
    """The per-task hooks that make a stage exactly-once (or not)."""

    mode: Mode
    chunk_size: int

    def open(self) -> Replay:
        """Start the task; return what earlier attempts committed."""
        ...

    def admit(self, rows: list[InRow]) -> Admission:
        """Split a chunk into fresh rows and rows to skip."""
        ...

    def read_state(self, node: str, keys: Sequence[bytes]) -> Mapping[bytes, bytes | None]:
        """Current keyed state of ``node`` for ``keys``."""
        ...

    def commit(
        self,
        chunk: int,
        fresh: list[InRow],
        outputs: list[Output],
        updates: Mapping[str, Mapping[bytes, bytes]],
    ) -> set[bytes]:
        """Atomically store a chunk's effects; return IDs that conflicted (nothing stored)."""
        ...

    def finish(self, outputs: list[Output], updates: Mapping[str, Mapping[bytes, bytes]]) -> None:
        """Commit end-of-task outputs and mark the task done."""
        ...

    def undelivered(self, target: TargetSpec, outputs: list[Output]) -> list[Output]:
        """The sink records not yet delivered by any attempt."""
        ...

    def delivered(self, target: TargetSpec, outputs: list[Output]) -> None:
        """Mark sink records delivered (after the sink acknowledged them)."""
        ...

    def close(self) -> dict[str, int]:
        """End the task; return counters for the run's metrics."""
        ...


class NoGuard:
    """Bounded runs: no IDs, no backup, no dedup; a failed task simply runs again."""

    mode = Mode.BOUNDED
    chunk_size = 0  # whole Arrow batches

    def open(self) -> Replay:
        """Nothing was committed before."""
        return Replay()

    def admit(self, rows: list[InRow]) -> Admission:
        """Everything is fresh."""
        return Admission(rows)

    def read_state(self, node: str, keys: Sequence[bytes]) -> Mapping[bytes, bytes | None]:
        """Bounded combines keep no state outside the task."""
        return {}

    def commit(
        self,
        chunk: int,
        fresh: list[InRow],
        outputs: list[Output],
        updates: Mapping[str, Mapping[bytes, bytes]],
    ) -> set[bytes]:
        """Nothing to store."""
        return set()

    def finish(self, outputs: list[Output], updates: Mapping[str, Mapping[bytes, bytes]]) -> None:
        """Nothing to store."""

    def undelivered(self, target: TargetSpec, outputs: list[Output]) -> list[Output]:
        """Everything is new."""
        return outputs

    def delivered(self, target: TargetSpec, outputs: list[Output]) -> None:
        """Nothing to mark."""

    def close(self) -> dict[str, int]:
        """No counters of its own."""
        return {}


class GuardFactory(Protocol):
    """Builds a guard for one task on the worker (pickled from the driver)."""

    def __call__(self, spec: StageSpec, batch: int, partition: int, attempt: int) -> Guard:
        """A guard for this task."""
        ...


def no_guard(spec: StageSpec, batch: int, partition: int, attempt: int) -> Guard:
    """The bounded-run guard factory."""
    return NoGuard()


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
        task = TaskRun(self.spec, self.guards, self.batch, partition, attempt)
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

    def __init__(
        self, spec: StageSpec, guards: GuardFactory, batch: int, partition: int, attempt: int
    ) -> None:
        self.spec = spec
        self.batch = batch
        self.partition = partition
        self.attempt = attempt
        self.guard = guards(spec, batch, partition, attempt)
        self.body = StageBody(spec, self.guard.mode, batch, partition)
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
        self.body.flush_end(self.guard.read_state, partial_tag="end")
        outputs = self.body.take()
        self.guard.finish(outputs, {})
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
        todo = self.guard.undelivered(target, outputs)
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
            self.guard.delivered(target, todo)

    def writer(self, target: TargetSpec) -> Any:
        """The task's writer for a sink target, opened on first use."""
        writer = self.writers.get(target.index)
        if writer is None:
            from connectors.base import TaskInfo

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


# -- fault injection for the crash tests ------------------------------------------------------

CRASH_ENV = "ONCEFLOW_CRASH"


def crashpoint(point: str, stage: str, batch: int, partition: int, attempt: int) -> None:
    """Fail here when ``$ONCEFLOW_CRASH`` asks for it (tests only; free otherwise).

    ``ONCEFLOW_CRASH="point=after_commit,stage=count,batch=1,partition=0,mode=raise"``: fields
    left out match anything, ``attempt`` defaults to 0 so a retried task gets through. With
    ``mode=raise`` the task fails (Spark retries it); with ``mode=kill`` the process writes
    ``$ONCEFLOW_CRASH_FILE`` and freezes, so that the test harness kills the whole run with
    SIGKILL at exactly this point.
    """
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return
    wanted = dict(item.split("=", 1) for item in spec.split(",") if "=" in item)
    actual = {
        "point": point,
        "stage": stage,
        "batch": str(batch),
        "partition": str(partition),
        "attempt": str(attempt),
    }
    wanted.setdefault("attempt", "0")
    if any(wanted[k] != v for k, v in actual.items() if k in wanted):
        return
    trigger_crash(wanted.get("mode", "raise"), f"{point} {stage} b{batch} p{partition}")


def trigger_crash(mode: str, where: str) -> None:
    """Fail (``raise``) or freeze until killed (``kill``); see :func:`crashpoint`."""
    import time

    path = os.environ.get("ONCEFLOW_CRASH_FILE")
    if path:
        with open(path, "a") as fh:
            fh.write(where + "\n")
    if mode == "kill":
        for _ in itertools.count():
            time.sleep(3600)
    msg = f"injected failure at {where}"
    raise RuntimeError(msg)
