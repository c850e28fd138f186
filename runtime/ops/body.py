"""Executor side: the ops of one fused stage, run a chunk at a time.

A chunk's rows run through the stage's ops in graph order, each op applied to the list of
elements its producer made (:mod:`~.flow`, :mod:`~.each`); what reaches a boundary (a port, a
sink or the dead-letter output) is buffered with its parent's ID and timestamp.
:meth:`StageBody.take` then encodes the buffered elements and, with IDs on, derives each
output's ID from its parent, the boundary's name and its index among that parent's outputs on
that boundary. Outputs, their order and IDs, and dead letters are those of running each
element through the stage depth first.

Combines fold per key. In a bounded run a combine holds its accumulators for the whole task.
In a streaming run a full or final combine is *stateful*: each chunk's per-key deltas are
merged into state kept by the runtime (Redis), and at the end of the task the new value of
every key touched by the batch is emitted (see :mod:`~.combine_flush`). Partial combines
flush per chunk when IDs are on (their output must be committed with the chunk's input) and
once per task otherwise.
Windowed combines (:mod:`~.windowed_combine`) emit panes instead, when their
trigger says so; a record whose windows have all closed becomes a dead letter. Process ops
(user state and timers, :mod:`~.process`) run a chunk's records when it commits and fire
timers at the end of the task. The parts:
:mod:`~.boundaries` (buffers and encoding), :mod:`~.combine` (combines without windows),
:mod:`~.combine_flush` (the end of the task), :mod:`~.flow` (a chunk through the ops); this
module wires the ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from onceflow.kernel.ids import Deriver
from onceflow.kernel.records import DeadLetter, Guarantee, InRow, Output, Record, StateWrite
from onceflow.runtime.errors import StopStage
from onceflow.runtime.ops.boundaries import Boundaries
from onceflow.runtime.ops.combine import CombineOp, StateReader
from onceflow.runtime.ops.combine_flush import (
    CombineFlush,
    TimerReader,
    chunk_deltas,
    seed_partials,
)
from onceflow.runtime.ops.flow import Flow
from onceflow.runtime.ops.process import Processes, ProcessOp
from onceflow.runtime.ops.record_text import (
    Cursor,
    Origins,
    as_json,
    error_text,
    letter_code,
    stage_failure,
)
from onceflow.runtime.ops.windowed_combine import WindowedCombine
from onceflow.runtime.spec import OpKind, OpSpec, Phase, StageSpec, TargetSpec


class StageBody:
    """The ops of one stage for one task."""

    def __init__(
        self,
        spec: StageSpec,
        mode: Guarantee,
        batch: int,
        partition: int,
        watermarks: tuple[int | None, int | None] = (None, None),
        now: int | None = None,
    ) -> None:
        self.spec = spec
        self.mode = mode
        self.batch = batch
        self.partition = partition
        self.watermarks = watermarks  # the micro-batch's and the batch before's (None: bounded)
        self.watermark, self.previous_watermark = watermark, _ = watermarks
        self.now = now  # the micro-batch's time (None: bounded)
        self.limit_ms: int | None = None  # the newest event time admitted (set by the task)
        self.cursor = Cursor()
        self.out = Boundaries(spec, mode.ids, self.cursor, self._origin)
        self.flow = Flow(spec, self.out, self.cursor, self._fail, lambda: self.limit_ms)
        self.combines: dict[str, CombineOp | WindowedCombine] = {}
        self.processes = Processes()
        self.op_derivers: dict[str, Deriver] = {}
        self.origins = Origins()  # source records: where they were read
        for op in spec.ops:
            if op.kind is OpKind.COMBINE:
                self._build_combine(op)
            elif op.kind is OpKind.PROCESS:
                self._build_process(op)
        self.end = CombineFlush(
            spec,
            self.combines,
            self.op_derivers,
            self.cursor,
            (batch, partition, watermark, now),
            self.flow.outlet,
            self._fail,
            self.flow.emitting,
        )

    @property
    def dead_count(self) -> int:
        """Dead letters made so far."""
        return self.out.dead_count

    @property
    def dead_codes(self) -> dict[str, int]:
        """Dead letters made so far, by reason (DeadLetter.code)."""
        return self.out.dead_codes

    # -- wiring --------------------------------------------------------------------------

    def _build_combine(self, op: OpSpec) -> None:
        stateful = self.mode.streaming and op.phase is not Phase.PARTIAL
        chunked = self.mode.ids and op.phase is Phase.PARTIAL
        combine: CombineOp | WindowedCombine
        if op.windowing is not None:
            combine = WindowedCombine(op, stateful, chunked, self.watermarks, self.now)
        else:
            combine = CombineOp(op, stateful, chunked, self.now)
        self.combines[op.name] = combine
        if self.mode.ids:
            self.op_derivers[op.name] = Deriver(op.name)
        self.flow.fold(op, combine)

    def _build_process(self, op: OpSpec) -> None:
        where = (self.batch, self.watermark, self.now, self.mode)
        out = self.flow.outlet(op)
        proc = ProcessOp.build(op, where, self.cursor, self._fail, out, self.previous_watermark)
        self.processes[op.name] = proc
        self.flow.fold(op, proc)

    def _fail(self, node: str, exc: BaseException, elem: Any) -> None:
        if self.spec.on_error == "fail" or isinstance(exc, StopStage):
            failure = stage_failure(node, elem, exc)
            failure.__cause__ = exc
            self.out.stop(failure)
            return
        value, replayable = as_json(elem)
        self.out.letter(node, error_text(exc), value, letter_code(exc), json_value=replayable)

    def _origin(self, parent: bytes) -> str:
        """Where record ``parent`` was read (a source's record), or which task made it."""
        where = f"batch {self.batch} partition {self.partition}"
        read_at = self.origins.get(parent) if parent else None
        if read_at is not None:  # a source record: where it was read (topic:partition@offset)
            return f"{read_at} (record {parent.hex()}, {where})"
        return f"record {parent.hex()} ({where})" if parent else where

    def counts(self) -> tuple[int, dict[str, int], dict[str, int]]:
        """Dead letters (in all, per code) and closed-window parts counted so far."""
        closed = {
            n: c.closed_parts for n, c in self.combines.items() if isinstance(c, WindowedCombine)
        }
        return self.dead_count, dict(self.dead_codes), closed

    def restore_counts(self, saved: tuple[int, dict[str, int], dict[str, int]]) -> None:
        """Counts back as :meth:`counts` saw them: a redone chunk must not count twice."""
        self.out.dead_count, codes, closed = saved
        self.out.dead_codes = dict(codes)
        for name, n in closed.items():
            self.combines[name].closed_parts = n  # type: ignore[union-attr]

    def dead(self, letter: DeadLetter) -> None:
        """Send a dead letter to the stage's dead-letter output."""
        self.out.dead(letter)

    # -- feeding -------------------------------------------------------------------------

    def run(self, rows: Sequence[InRow]) -> None:
        """Run input rows through the stage (see :mod:`~.flow`)."""
        self.flow.run(rows)

    def touch(self, inbound: int, kb: bytes, key: Any, ts: int) -> None:
        """A replayed record whose effect is already committed: mark its key touched."""
        for name in self.spec.inbound[inbound].entries:
            combine = self.combines.get(name)
            if combine is not None and combine.stateful:
                combine.touch(kb, key, ts)

    # -- combines ------------------------------------------------------------------------

    def partial_deltas(self) -> list[Output]:
        """This chunk's partial-combine deltas, to back up with it (see :func:`chunk_deltas`)."""
        return chunk_deltas(self.spec, self.combines)

    def seed_partials(self, outputs: list[Output]) -> None:
        """Re-seed partial sums from deltas an earlier attempt committed."""
        seed_partials(self.spec, self.combines, outputs)

    def state_updates(self, reader: StateReader) -> dict[str, StateWrite]:
        """New state of every stateful combine for the keys changed in this chunk.

        Windowed combines that fire a pane per late record emit those panes here: they
        leave with the chunk's commit.
        """
        out: dict[str, StateWrite] = {}
        for name, combine in self.combines.items():
            if not combine.stateful:
                continue
            if isinstance(combine, WindowedCombine):
                with self.flow.emitting():
                    write = combine.updates(reader, self.end.pane_emitter(combine))
            else:
                write = combine.updates(reader)
            if write:
                out[name] = write
        # runs the user's function on the chunk
        self.processes.updates(reader, out, self.flow.emitting)
        return out

    def closed_parts(self) -> int:
        """Window memberships dropped because that window had closed (sliding windows)."""
        return sum(c.closed_parts for c in self.combines.values() if isinstance(c, WindowedCombine))

    def chunk_committed(self) -> None:
        """The chunk is durable."""
        self.out.made.chunk_committed()
        for combine in self.combines.values():
            if combine.stateful or combine.chunked:
                combine.chunk_committed()
        self.processes.chunk_committed()

    def reset_chunk(self) -> None:
        """Drop everything the chunk produced (its commit was refused; it will be redone)."""
        self.out.clear()
        for combine in self.combines.values():
            if combine.stateful or combine.chunked:
                combine.reset_chunk()
        self.processes.reset_chunk()

    def flush_end(
        self, reader: StateReader | None, timers: TimerReader | None = None
    ) -> dict[str, StateWrite]:
        """End of task: emit combine results, in graph order (see :mod:`~.combine_flush`).

        Returns the state changes of windowed combines (panes fired, windows closed): they
        are committed with the task's end-of-task outputs.
        """
        # process ops first: each begins its stage (after its exchange), so the combines of
        # the stage are downstream of it, and what its timers emit must reach them before
        # they flush (a lifted partial combine flushed first would lose it)
        changes: dict[str, StateWrite] = {}
        self.processes.fire(reader, timers, changes, self.flow.emitting)  # timers due fire
        changes.update(self.end.flush_end(reader, timers))
        return changes

    # -- outputs -------------------------------------------------------------------------

    def sink_records(self, outputs: Sequence[Output], target: TargetSpec) -> list[Record]:
        """What a sink writes for ``outputs`` (see :mod:`~.made`)."""
        return self.out.made.records(outputs, target)

    def delivered_elsewhere(self) -> None:
        """Keep no elements of sink outputs: the batch's delivery job delivers them.

        It reads them from the backup (:mod:`onceflow.runtime.task.deferred`).
        """
        self.out.made.keeping = False

    def take(self) -> list[Output]:
        """Encode everything buffered at the boundaries, deriving IDs when they are on."""
        return self.out.take()
