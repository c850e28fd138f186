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
   holding them changes when they become visible, not whether. Where a batch's deliveries
   wait for one durability confirmation (Redis ``everysec`` with ``WAITAOF``, a group
   commit), the task holds them only: the batch's delivery job delivers them after the wait
   (:mod:`~.deferred`).

Every unit is bounded by bytes as well as by count (:mod:`onceflow.kernel.limits`): chunks
(:mod:`~.chunking`, and again by what a chunk writes), deliveries, the Arrow
batches handed back to Spark and the slices a source's records are decoded in.
4. ``finish`` commits the end-of-task outputs (combine results) and marks the task done;
   what is still held is delivered.

The guard contract and the cheap guards are in :mod:`onceflow.runtime.guard`; the
exactly-once guard is :mod:`onceflow.dedup.guard`. The parts: :mod:`~.inputs` reads and
chunks the input, :mod:`~.commits` admits, runs and commits a chunk, :mod:`~.sink_delivery`
(with :mod:`~.sink_transactions` for transactional sinks) delivers sink outputs; :class:`TaskRun`
is the loop over them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterator, Mapping, Sequence
from itertools import chain
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from onceflow.connectors.errors import ConnectorError
from onceflow.dedup.errors import FencedError
from onceflow.kernel import record_types
from onceflow.kernel.limits import Budget, split_outputs
from onceflow.kernel.records import InRow, Output, StateWrite, TaskRef
from onceflow.runtime.errors import TASK_FAILURE_MARK, RuntimeFailure, TaskFailure
from onceflow.runtime.faults import CrashPoint, crashpoint
from onceflow.runtime.guard import GuardFactory
from onceflow.runtime.metrics import dead_letter_counter
from onceflow.runtime.ops.body import StageBody
from onceflow.runtime.spec import StageSpec
from onceflow.runtime.task import heap
from onceflow.runtime.task import times as task_times
from onceflow.runtime.task.commits import ChunkCommits
from onceflow.runtime.task.inputs import ROW_COLUMNS, TaskInput
from onceflow.runtime.task.sink_delivery import SinkDelivery

if TYPE_CHECKING:
    import pyarrow as pa

MAX_FAILURE_CHARS = 600
_TARGET = attrgetter("target")
ROW_SCHEMA = "id binary, ts long, key binary, value binary, port int"


# Spark local property holding a streaming micro-batch's guard parameters (JSON), read by
# stage functions made once per run (``batch=None``, see
# onceflow.runtime.driver.compile.StreamCompiler).
BATCH_PROPERTY = "onceflow.batch"
BATCH_ID_PROPERTY = "onceflow.batch.id"
# The column in which a stage that reads no exchange finds its own partition: Spark's index of
# the partition of the stage's own input, written by the compiler (see StageFunction).
PARTITION_COLUMN = "onceflow_partition"


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
        """Run the task over the partition's Arrow batches (see :meth:`partition`)."""
        from pyspark import TaskContext

        ctx = TaskContext.get()
        partition, batches = self.partition(ctx, batches)
        if partition is None:  # an empty partition of a stage that reads no exchange
            return
        attempt = ctx.attemptNumber() if ctx is not None else 0
        attempt_id = ctx.taskAttemptId() if ctx is not None else 0
        batch, guards = self._batch(ctx)
        record_types.register(self.spec.record_types)
        ref = TaskRef(self.spec.name, batch, partition, attempt, self.spec.sinks, attempt_id)
        times = task_times.begin()
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
            if times is not None:
                for name, n in times.counters().items():
                    task.count(name, n)
                task_times.end()
            if self.metrics is not None and ok:
                self.metrics.add(task.counters)

    def partition(
        self, ctx: Any, batches: Iterator[pa.RecordBatch]
    ) -> tuple[int | None, Iterator[pa.RecordBatch]]:
        """The stage partition this task runs, and its input.

        Keyed state, timers, backups, seen-marks' scopes and sinks' transactional ids are
        kept per stage partition, so it must be the stage's own wherever Spark computes the
        stage. Spark's task partition id is not: inside a union it is the union's index, and
        a stage read twice is persisted and computed in whichever reader's task needs it
        first (at offset k in one union, |other|+k in another).

        * An exchange stage: Spark's partition id modulo its partition count. It has one
          partition per key range even when it is empty (its timers fire there), and every
          union puts such stages at multiples of that count
          (:mod:`onceflow.runtime.driver.compile`).
        * Any other stage: the index of the partition in the stage's own input, which the
          compiler evaluates below the stage (``spark_partition_id()`` into
          :data:`PARTITION_COLUMN`, dropped here) — the same in every reader's union, for a
          cached block lost and recomputed, and on a replay in any order. An empty partition
          has no row to tell it, and nothing to do: no input, so no attempt of it ever
          committed, delivered or set anything (None; the task is skipped).

        Outside Spark (no task context) the partition is 0, unless the column says.
        """
        if self.partitions:
            return (ctx.partitionId() if ctx is not None else 0) % self.partitions, batches
        return own_partition(batches, required=ctx is not None, stage=self.spec.name)

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
    """The state of one running task: the loop over its input, commits and deliveries."""

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
            (self.guard.watermark, self.guard.previous_watermark),
            self.guard.batch_time_ms,
        )
        self.body.limit_ms = self.guard.limit_ms
        self.counters: dict[str, int] = {}
        self.closed = False
        self.input = TaskInput(spec, self.guard, self.body, self.count)
        self.origins = self.input.origins  # source records of the current input batch
        self.body.origins = self.origins
        self.commits = ChunkCommits(
            spec, self.guard, self.body, self.origins, self.count, self.crash
        )
        self.sinks = SinkDelivery(spec, self.guard, self.body, task, self.count, self.crash)

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
        """A crashpoint of this task (free unless a test armed one: onceflow.runtime.faults)."""
        crashpoint(point, self.spec.name, self.batch, self.partition, self.attempt)

    def count(self, name: str, n: int = 1) -> None:
        """Add to a counter named ``stage/name``."""
        key = f"{self.spec.name}/{name}"
        self.counters[key] = self.counters.get(key, 0) + n

    # -- the loop ------------------------------------------------------------------------

    def run(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """Steps 1-4 of the module docstring."""
        heap.settle()  # once per worker process (see onceflow.runtime.task.heap)
        with task_times.timed("redis open"):
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
            self.guard.confirm_outputs()  # what an earlier attempt committed, it handed on
            return
        chunk_no = replay.next_chunk
        chunks = task_times.timed_iter("input", self.input.chunks(batches))
        for rows, lanes, positional, fingerprints in chunks:
            outputs, chunk_no = self.process_chunk(chunk_no, rows, lanes, positional, fingerprints)
            yield from self.emit(outputs)
        self.close_counts()
        with task_times.timed("stage end"):
            changes = self.body.flush_end(self.guard.read_state, self.guard.due_timers)
        outputs = self.finish(chunk_no, self.body.take(), changes, {o.id for o in sent})
        yield from self.emit(outputs)
        yield from self.release()
        yield from self.flush_sinks()
        self.guard.confirm_outputs()  # durable before a stage on another master reads them
        self.crash(CrashPoint.TASK_END)

    def process_chunk(
        self,
        chunk_no: int,
        rows: list[InRow],
        lanes: Mapping[str, int],
        positional: Sequence[bool] = (),
        fingerprints: Sequence[int] = (),
    ) -> tuple[list[Output], int]:
        """Admit, run and commit one chunk; return its outputs and the next chunk's number.

        ``lanes``: the newest admissible event time per source lane among the chunk's rows;
        ``positional``: per row, whether its ID is a positional one (empty: none is, see
        :class:`~onceflow.kernel.records.Record`); ``fingerprints``: per row, its content
        fingerprint (empty: none known). A chunk whose writes pass the chunk's bytes is
        committed in parts, each numbered as a chunk of its own.
        """
        # Dead letters of records that failed to decode before the chunk was formed: they
        # leave with the chunk's first commit, whatever has to be redone.
        carried = self.body.take()
        self.input.letter_bytes = 0
        admission, outputs, chunk_no = self.commits.attempt(
            chunk_no, rows, carried, lanes, positional, fingerprints
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
        with task_times.timed("redis finish"):
            self.guard.finish(parts[-1], changes)
        self.crash(CrashPoint.AFTER_FINISH)
        return outputs

    def close_counts(self) -> None:
        """Counters only known at the end of the task."""
        closed = self.body.closed_parts()
        if closed:
            self.count("window_closed_parts", closed)
            self.guard.note("window_closed_parts", closed)

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
        made = Counter(map(_TARGET, outputs))
        for index, n in made.items():
            self.count(f"out/{targets[index].name}", n)
        sinks = [t for t in made if not targets[t].is_row]
        rows = outputs if not sinks else [o for o in outputs if targets[o.target].is_row]
        new = {t: [o for o in outputs if o.target == t] for t in sinks}
        yield from self.arrow_batches(rows + self.sinks.hold(new))

    def arrow_batches(self, rows: list[Output]) -> Iterator[pa.RecordBatch]:
        """Rows as Arrow batches of at most a chunk's bytes (one oversized row alone)."""
        if rows:
            for part in split_outputs(rows, Budget(0, self.guard.chunk_bytes)):
                yield to_arrow(part)

    def release(self) -> Iterator[pa.RecordBatch]:
        """Deliver every sink output still held; yield dead letters that leave as rows."""
        yield from self.arrow_batches(self.sinks.deliver_held(list(self.sinks.held)))

    def flush_sinks(self) -> Iterator[pa.RecordBatch]:
        """Flush every writer; yield dead letters of records refused only now, as rows."""
        yield from self.arrow_batches(self.sinks.flush())

    def close(self, ok: bool) -> None:
        """Close (or, after a failure, abort) writers and the guard; collect counters."""
        if self.closed:
            return
        self.closed = True
        self.sinks.close(ok)
        for name, n in self.guard.close().items():
            self.count(name, n)
        if self.body.dead_count:
            self.count("dead_letters", self.body.dead_count)
        for code, n in self.body.dead_codes.items():
            self.count(dead_letter_counter(code), n)


def own_partition(
    batches: Iterator[pa.RecordBatch], *, required: bool = True, stage: str = ""
) -> tuple[int | None, Iterator[pa.RecordBatch]]:
    """The partition :data:`PARTITION_COLUMN` names, and the batches without the column.

    None (and no batches) for an input without a row. ``required``: a batch without the
    column is a runner bug; otherwise (a stage run outside Spark) such an input, or one
    without a row, is partition 0.
    """
    for batch in batches:
        if PARTITION_COLUMN not in batch.schema.names:
            if required:
                msg = f"stage {stage!r} got no {PARTITION_COLUMN!r} column; this is a runner bug"
                raise RuntimeFailure(msg)
            return 0, chain((batch,), batches)
        if batch.num_rows:
            partition = batch.column(PARTITION_COLUMN)[0].as_py()
            return int(partition), _without_partition(chain((batch,), batches))
    return (None if required else 0), iter(())


def _without_partition(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    for batch in batches:
        yield batch.drop_columns([PARTITION_COLUMN])


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
