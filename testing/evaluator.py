"""Run a streaming job in this process, as Spark would run it, without Spark, Redis or Kafka.

The evaluator executes the code Spark's tasks execute —
:class:`~onceflow.runtime.task.loop.TaskRun` with the stage bodies, combines and windowed
combines of :mod:`onceflow.runtime.ops` (windows, triggers, lateness and panes are
:class:`~onceflow.runtime.ops.windowed_combine.WindowedCombine`'s own) — and
replaces only what surrounds it:

* Spark: each stage runs as one task (one partition) per micro-batch, in the job's order;
  rows between stages are the same Arrow batches, and with one partition an exchange needs
  no shuffle. A source stage runs only when its stream has rows in the batch, as Spark runs
  no task for a source with no input partition.
* Redis: a :class:`MemoryGuard` keeps keyed state, timers, seen IDs and source lanes in
  dictionaries, with the exactly-once guard's admission rules: a copy of a record already
  seen is dropped, a record older than the dedup horizon or further ahead of the clock than
  allowed becomes a dead letter.
* The driver: each micro-batch's time and watermark are computed as
  :func:`~onceflow.dedup.batch.fix_batch_params` computes them (from the lanes earlier
  batches committed, with :func:`~onceflow.kernel.eventtime.watermark`), and after each batch
  a micro-batch without records is run when a window's event-time timer is due by the next
  watermark, as :class:`~onceflow.runtime.driver.ticks.Ticker` asks Spark for one.

Steps and ticks are scheduled as the Spark data source of test streams schedules them
(:mod:`onceflow.testing.spark_stream`): each batch takes the next step of every stream, except
that a tick batch takes no step of the stream that ticks (the job's first source). Processing
time moves only when a stream says so (``advance_processing_time``); on Spark the clock also
runs on its own. Nothing fails here, so nothing is retried or replayed: crash behaviour is
what :mod:`onceflow.testing.harness` tests, against the real services.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from onceflow.dedup.admission import Admission
from onceflow.dedup.config import DedupConfig
from onceflow.dedup.state import EVENT, PROCESSING
from onceflow.kernel import codec
from onceflow.kernel.eventtime import EventTime, watermark
from onceflow.kernel.records import Guarantee, InRow, Output, StateWrite, TaskRef
from onceflow.runtime.driver.result import RunResult, explain_failure
from onceflow.runtime.errors import RunError
from onceflow.runtime.guard import NoGuard
from onceflow.runtime.task.inputs import ROW_COLUMNS
from onceflow.runtime.task.loop import TaskRun, to_arrow
from onceflow.testing.errors import TestingError
from onceflow.testing.steps import CLOCK
from onceflow.testing.teststream import TestStream

if TYPE_CHECKING:
    import pyarrow as pa

    from onceflow.runtime.spec import Job, StageSpec

PARTITION = 0
# A job whose ticks never stop would be a bug in the runtime; stop rather than spin.
MAX_TICKS_IN_A_ROW = 1000


@dataclass
class MemoryStore:
    """What Redis holds for a streaming run, as far as the evaluator needs it."""

    state: dict[tuple[str, int], dict[bytes, bytes]] = field(default_factory=dict)
    timers: dict[tuple[str, str, int], dict[bytes, int]] = field(default_factory=dict)
    seen: dict[str, set[bytes]] = field(default_factory=dict)
    lanes: dict[str, int] = field(default_factory=dict)  # lane -> newest event time
    activity: dict[str, int] = field(default_factory=dict)  # lane -> last batch time

    def write(self, partition: int, updates: Mapping[str, StateWrite]) -> None:
        """Apply state and timer changes (None deletes), as the commit scripts do."""
        for node, change in updates.items():
            values = self.state.setdefault((node, partition), {})
            for kb, value in change.values.items():
                if value is None:
                    values.pop(kb, None)
                else:
                    values[kb] = value
            for kind, members in change.timers.items():
                timers = self.timers.setdefault((kind, node, partition), {})
                for kb, at in members.items():
                    if at is None:
                        timers.pop(kb, None)
                    else:
                        timers[kb] = at

    def raise_lanes(self, lanes: Mapping[str, int], batch_time_ms: int) -> None:
        """Each lane's newest event time only grows; its activity is the batch's time."""
        for lane, newest in lanes.items():
            if newest > self.lanes.get(lane, -1):
                self.lanes[lane] = newest
            self.activity[lane] = batch_time_ms

    def lane_view(self) -> dict[str, tuple[int, int]]:
        """Lanes as :func:`~onceflow.dedup.batch.lanes_of` returns them."""
        return {lane: (ts, self.activity.get(lane, 0)) for lane, ts in self.lanes.items()}

    def due(self, node: str, partition: int, wm: int, now: int) -> list[bytes]:
        """Keys with an event-time timer at or before ``wm`` or a processing one before ``now``."""
        event = self.timers.get((EVENT, node, partition), {})
        processing = self.timers.get((PROCESSING, node, partition), {})
        keys = [kb for kb, at in event.items() if at <= wm]
        keys += [kb for kb, at in processing.items() if at <= now]
        return list(dict.fromkeys(keys))

    def earliest_event_timer(self, nodes: Iterable[str]) -> int | None:
        """The earliest event-time timer of any of ``nodes``."""
        found = [
            at
            for (kind, node, _p), members in self.timers.items()
            if kind == EVENT and node in nodes
            for at in members.values()
        ]
        return min(found, default=None)


@dataclass(frozen=True)
class BatchClock:
    """What one micro-batch decides with: its time, watermark, late floor and ahead limit."""

    batch: int
    time_ms: int
    watermark: int
    floor: int  # oldest event-time bucket admitted
    limit_ms: int  # newest event time admitted
    previous_watermark: int  # the batch before's: windows it closed are closed


class MemoryGuard(NoGuard):
    """The exactly-once guard's hooks for one task, kept in a :class:`MemoryStore`.

    Nothing fails in process, so nothing is replayed or left pending: opening a task and the
    delivery hooks are :class:`~onceflow.runtime.guard.NoGuard`'s.
    """

    mode = Guarantee.EXACTLY_ONCE

    def __init__(
        self, store: MemoryStore, task: TaskRef, clock: BatchClock, config: DedupConfig
    ) -> None:
        self.store = store
        self.stage = task.stage
        self.partition = task.partition
        self.chunk_size = config.chunk_size
        self.chunk_bytes = config.chunk_bytes
        self.delivery = config.delivery
        self.bucket_ms = config.bucket_ms
        self.floor = clock.floor
        self.limit_ms: int | None = clock.limit_ms
        self.watermark: int | None = clock.watermark
        self.previous_watermark: int | None = clock.previous_watermark
        self.batch_time_ms: int | None = clock.time_ms
        self.counts: dict[str, int] = {}

    def admit(
        self,
        rows: list[InRow],
        positional: Sequence[bool] = (),
        fingerprints: Sequence[int] = (),
    ) -> Admission:
        """Late, ahead, copies, fresh: the rules of :mod:`onceflow.dedup.admission`.

        In-process sources read no bytes, so no record has a content fingerprint.
        """
        seen = self.store.seen.setdefault(self.stage, set())
        in_chunk: set[bytes] = set()
        adm = Admission([])
        for row in rows:
            rid, ts = row[1], row[2]
            if ts // self.bucket_ms < self.floor:
                adm.late.append(row)
            elif self.limit_ms is not None and ts > self.limit_ms:
                adm.ahead.append(row)
            elif rid in in_chunk or rid in seen:
                adm.duplicates += 1
            else:
                in_chunk.add(rid)
                adm.fresh.append(row)
        return adm

    def read_state(self, node: str, keys: Sequence[bytes]) -> Mapping[bytes, bytes | None]:
        """Current state of ``keys``."""
        values = self.store.state.get((node, self.partition), {})
        return {kb: values.get(kb) for kb in keys}

    def due_timers(self, node: str, watermark: int, now: int) -> Sequence[bytes]:
        """Keys with a timer due."""
        return self.store.due(node, self.partition, watermark, now)

    def commit(
        self,
        chunk: int,
        fresh: list[InRow],
        outputs: list[Output],
        updates: Mapping[str, StateWrite],
        lanes: Mapping[str, int],
        unmarked: Collection[bytes] = frozenset(),
    ) -> set[bytes]:
        """Mark ``fresh`` seen, write state and raise the lanes; nothing ever conflicts."""
        self.store.seen.setdefault(self.stage, set()).update(row[1] for row in fresh)
        self.store.write(self.partition, updates)
        if lanes and self.batch_time_ms is not None:
            self.store.raise_lanes(lanes, self.batch_time_ms)
        return set()

    def finish(self, outputs: list[Output], changes: Mapping[str, StateWrite]) -> None:
        """Write the end-of-task state changes (windows fired and closed)."""
        self.store.write(self.partition, changes)

    def note(self, name: str, n: int) -> None:
        """Counted with the task's counters."""
        self.counts[name] = self.counts.get(name, 0) + n

    def close(self) -> dict[str, int]:
        """No counters of its own."""
        return {}


@dataclass(frozen=True)
class MemoryGuards:
    """The guard factory of one micro-batch."""

    store: MemoryStore
    clock: BatchClock
    config: DedupConfig

    def __call__(self, task: TaskRef) -> MemoryGuard:
        """A guard for one task."""
        return MemoryGuard(self.store, task, self.clock, self.config)


class Evaluator:
    """Runs a job whose sources are :class:`TestStream` s (see the module docstring)."""

    def __init__(self, job: Job, *, start_time_ms: int | None = None) -> None:
        for name, connector in job.sources:
            if not isinstance(connector, TestStream):
                msg = (
                    f"source {name!r} is {connector.describe()}, not a TestStream; the "
                    "in-process evaluator reads test streams only (run_test replaces sources)"
                )
                raise TestingError(msg)
        self.job = job
        self.streams: dict[str, TestStream] = dict(job.sources)
        self.config: DedupConfig = job.dedup or DedupConfig()
        self.event_time: EventTime = job.event_time or EventTime()
        self.store = MemoryStore()
        self.clock_ms = round(time.time() * 1000) if start_time_ms is None else start_time_ms
        self.time_ms = 0  # the previous batch's time (batch times never go back)
        self.watermark = 0  # the previous batch's watermark
        self.windowed = [  # ops with timers: windows, and process ops (user timers)
            op.name
            for _, op in job.stateful_ops()
            if op.windowing is not None or op.process is not None
        ]
        self.ticker = job.sources[0][0] if self.windowed and job.sources else None
        self.counters: dict[str, int] = {}
        self.batches = 0
        self.ticks = 0
        self.watermarks: list[int] = []

    # -- the driver ----------------------------------------------------------------------

    def run(self) -> RunResult:
        """Every step of every stream, and the ticks the windows ask for."""
        started = time.monotonic()
        for _name, connector in self.job.sources:
            connector.prepare(self.job.pipeline, True)
        for sink in self._sinks():
            sink.prepare(self.job.pipeline, True)
        cursors = dict.fromkeys(self.streams, 0)
        tick = False
        ticks_in_a_row = 0
        while True:
            steps: dict[str, int] = {}
            for name, stream in self.streams.items():
                if tick and name == self.ticker:
                    continue
                if cursors[name] < len(stream.steps):
                    steps[name] = cursors[name]
                    cursors[name] += 1
            if not tick and not steps:
                break
            self._run_batch(steps)
            tick = self._tick_due()
            ticks_in_a_row = ticks_in_a_row + 1 if tick else 0
            if ticks_in_a_row > MAX_TICKS_IN_A_ROW:
                msg = "windows asked for ticks without end; this is a runtime bug"
                raise TestingError(msg)
        for sink in self._sinks():
            sink.finish()
        dead = self.job.stages[0].targets[-1].connector if self.job.stages else None
        return RunResult(
            pipeline=self.job.pipeline,
            job=self.job,
            mode=Guarantee.EXACTLY_ONCE,
            seconds=time.monotonic() - started,
            counters=dict(self.counters),
            dead_letter_sink=dead.describe() if dead is not None else "none",
            batches=self.batches,
            extra={"ticks": self.ticks, "watermarks": list(self.watermarks), "evaluator": True},
        )

    def _sinks(self) -> list[Any]:
        found: list[Any] = []
        for stage in self.job.stages:
            for target in stage.targets:
                c = target.connector
                if c is not None and all(c is not s for s in found):
                    found.append(c)
        return found

    def _batch_clock(self) -> BatchClock:
        """The batch's time and watermark, as ``fix_batch_params`` fixes them."""
        now = max(self.clock_ms, self.time_ms)
        previous = self.watermark
        wm = watermark(self.store.lane_view(), now, previous, self.event_time)
        self.time_ms, self.watermark = now, wm
        floor, limit = self.config.floor(wm), self.event_time.limit(now)
        return BatchClock(self.batches, now, wm, floor, limit, min(previous, wm))

    def _tick_due(self) -> bool:
        """Whether a window's timer is due by the next watermark (as ``Ticker.after_batch``)."""
        if self.ticker is None:
            return False
        next_wm = watermark(self.store.lane_view(), self.clock_ms, self.watermark, self.event_time)
        earliest = self.store.earliest_event_timer(self.windowed)
        due = earliest is not None and earliest <= next_wm
        self.ticks += due
        return due

    # -- one micro-batch -----------------------------------------------------------------

    def _run_batch(self, steps: Mapping[str, int]) -> None:
        for name, step in steps.items():
            s = self.streams[name].steps[step]
            if s.kind == CLOCK:  # the clock moves before the batch starts
                self.clock_ms = max(self.clock_ms, self.time_ms) + s.ms
        clock = self._batch_clock()
        self.watermarks.append(clock.watermark)
        guards = MemoryGuards(self.store, clock, self.config)
        outputs: dict[str, list[Output]] = {}
        for spec in self.job.stages:
            inputs = self._inputs(spec, steps, outputs)
            if inputs is None:
                outputs[spec.name] = []
                continue
            outputs[spec.name] = self._task(spec, guards, inputs)
        for spec in self.job.stages:
            for target in spec.targets:
                if target.to_driver:
                    rows = [o for o in outputs[spec.name] if o.target == target.index]
                    target.connector.receive([_element(o) for o in rows])
        self.batches += 1

    def _inputs(
        self, spec: StageSpec, steps: Mapping[str, int], outputs: Mapping[str, list[Output]]
    ) -> list[pa.RecordBatch] | None:
        """The stage's input batches; None when Spark would run no task for it."""
        if spec.source is not None:
            step = steps.get(spec.source)
            stream = self.streams[spec.source]
            if step is None or stream.steps[step].rows == 0:
                return None
            return [stream.raw_rows(step)]
        rows = [
            Output(inbound.index, o.id, o.ts, o.key, o.value)
            for inbound in spec.inbound
            for o in outputs[inbound.producer]
            if o.target == inbound.port
        ]
        return [to_arrow(rows)] if rows else []

    def _task(
        self, spec: StageSpec, guards: MemoryGuards, inputs: list[pa.RecordBatch]
    ) -> list[Output]:
        ref = TaskRef(spec.name, self.batches, PARTITION, 0, spec.sinks, self.batches)
        task = TaskRun(spec, guards, ref)
        ok = False
        try:
            out = [row for batch in task.run(iter(inputs)) for row in _outputs(batch)]
            ok = True
        except Exception as exc:
            line = task.failure_line(exc)
            raise RunError(explain_failure(self.job.pipeline, Exception(line))) from exc
        finally:
            task.close(ok)
        for name, n in task.counters.items():
            self.counters[name] = self.counters.get(name, 0) + n
        return out


def _outputs(batch: pa.RecordBatch) -> list[Output]:
    """Rows a task yielded, back as outputs (``target`` is the row's port)."""
    rid, ts, key, value, port = (batch.column(c).to_pylist() for c in ROW_COLUMNS)
    return [Output(*row) for row in zip(port, rid, ts, key, value, strict=True)]


def _element(out: Output) -> Any:
    """A driver-bound row as the sink receives it (as ``CompiledBatch.run`` decodes it)."""
    value = codec.decode(out.value)
    return (codec.decode(out.key), value) if out.key is not None else value
