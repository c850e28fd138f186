"""Executor side: the ops of one fused stage, wired push-style.

Every element is pushed through the stage's ops; what reaches a boundary (a port, a sink or
the dead-letter output) is buffered with its parent's ID and timestamp. :meth:`StageBody.take`
then encodes the buffered elements and, with IDs on, derives each output's ID from its parent,
the boundary's name and its index among that parent's outputs on that boundary.

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
:mod:`~.combine_flush` (the end of the task); this module wires the ops.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from onceflow.kernel import codec
from onceflow.kernel.ids import Deriver
from onceflow.kernel.records import DeadLetter, Guarantee, InRow, Output, Redrive, StateWrite
from onceflow.runtime.errors import StopStage
from onceflow.runtime.ops.boundaries import Boundaries, Push
from onceflow.runtime.ops.combine import CombineOp, StateReader
from onceflow.runtime.ops.combine_flush import (
    CombineFlush,
    Fail,
    TimerReader,
    chunk_deltas,
    seed_partials,
)
from onceflow.runtime.ops.process import Processes, ProcessOp
from onceflow.runtime.ops.record_text import (
    Cursor,
    Origins,
    as_json,
    error_text,
    letter_code,
    portable,
    stage_failure,
)
from onceflow.runtime.ops.restamp import restamp_push
from onceflow.runtime.ops.windowed_combine import WindowClosedError, WindowedCombine
from onceflow.runtime.spec import OpKind, OpSpec, Phase, StageSpec


def fan_out(pushes: list[Push]) -> Push:
    """One push feeding every one of ``pushes``."""
    if len(pushes) == 1:
        return pushes[0]

    def fan(elem: Any) -> None:
        for p in pushes:
            p(elem)

    return fan


def flat_map(op: OpSpec, out: Push, cursor: Cursor, fail: Fail) -> Push:
    """The push of a flat-map op: its function's outputs go to ``out``."""
    assert op.fn is not None
    fn = op.fn
    timestamped = op.timestamped
    name = op.name

    def push(elem: Any) -> None:
        try:
            results = fn(elem, cursor.ts) if timestamped else fn(elem)
            if not isinstance(results, tuple | list):
                results = list(results)
        except Exception as exc:  # noqa: BLE001 - user code: dead-letter it
            fail(name, exc, elem)
            return
        for r in results:
            out(r)

    return push


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
        self.combines: dict[str, CombineOp | WindowedCombine] = {}
        self.processes = Processes()
        self.op_derivers: dict[str, Deriver] = {}
        self.origins = Origins()  # source records: where they were read
        self.push: dict[str, Push] = {}
        for op in reversed(spec.ops):  # consumers first, so producers can bind them
            self.push[op.name] = self._build(op)
        self.entries = [self._entry(i.entries, i.entry_targets) for i in spec.inbound]
        self.dispatch = [self._dispatcher(i.index) for i in spec.inbound]
        self.end = CombineFlush(
            spec,
            self.combines,
            self.op_derivers,
            self.cursor,
            (batch, partition, watermark, now),
            lambda op: fan_out(self._downstream(op)),
            self._fail,
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

    def _downstream(self, op: OpSpec) -> list[Push]:
        return [self.push[n] for n in op.to_ops] + [self.out.appender(t) for t in op.to_targets]

    def _build(self, op: OpSpec) -> Push:
        if op.kind is OpKind.COMBINE:
            return self._build_combine(op)
        if op.kind is OpKind.PROCESS:
            return self._build_process(op)
        return self._build_flat_map(op)

    def _build_flat_map(self, op: OpSpec) -> Push:
        assert op.fn is not None
        if op.restamp:
            out = fan_out(self._downstream(op))
            return restamp_push(op, out, self.cursor, self._fail, self.out, lambda: self.limit_ms)
        return flat_map(op, fan_out(self._downstream(op)), self.cursor, self._fail)

    def _build_combine(self, op: OpSpec) -> Push:
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
        return self._adder(combine)

    def _build_process(self, op: OpSpec) -> Push:
        where = (self.batch, self.watermark, self.now, self.mode)
        out = fan_out(self._downstream(op))
        proc = ProcessOp.build(op, where, self.cursor, self._fail, out, self.previous_watermark)
        self.processes[op.name] = proc
        return self._adder(proc)

    def _adder(self, combine: CombineOp | WindowedCombine | ProcessOp) -> Callable[..., None]:
        """Feed a combine ``(key, value)`` elements (and their key bytes, after an exchange)."""
        cursor = self.cursor
        fail = self._fail
        name = combine.spec.name
        encode = codec.encode
        closed = self._window_closed
        if isinstance(combine, WindowedCombine):
            combine.closed_windows = lambda reason, part: closed(name, reason, part)

        def push(elem: Any, kb: bytes | None = None) -> None:
            try:
                key, value = elem  # a process op runs it when the chunk commits
                combine.add(kb if kb is not None else encode(key), key, value, cursor.ts)
            except WindowClosedError as late:
                closed(name, str(late), elem)
            except Exception as exc:  # noqa: BLE001 - user code or a bad element
                fail(name, exc, elem)

        return push

    def _window_closed(self, node: str, reason: str, elem: Any) -> None:
        """A record too late for every one of its windows: a dead letter, never dropped."""
        self.out.letter(node, reason, portable(elem), "window_closed")

    def _entry(self, ops: tuple[str, ...], targets: tuple[int, ...]) -> Push:
        return fan_out([self.push[n] for n in ops] + [self.out.appender(t) for t in targets])

    def _fail(self, node: str, exc: BaseException, elem: Any) -> None:
        if self.spec.on_error == "fail" or isinstance(exc, StopStage):
            raise stage_failure(node, elem, exc) from exc
        value, replayable = as_json(elem)
        self.out.letter(node, error_text(exc), value, letter_code(exc), json_value=replayable)

    def _origin(self) -> str:
        parent = self.cursor.parent
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

    def run(self, rows: Iterable[InRow]) -> None:
        """Push input rows through the stage."""
        cursor = self.cursor
        dispatch = self.dispatch
        for inbound, rid, ts, kb, elem in rows:
            cursor.parent = rid
            cursor.ts = ts
            if elem.__class__ is Redrive:
                self._redrive(elem)
                continue
            dispatch[inbound](elem, kb)

    def _redrive(self, replayed: Redrive) -> None:
        """A record replayed from a dead letter goes straight to the node it failed in."""
        push = self.push.get(replayed.node)
        if push is None:
            self.out.unroutable(self.spec.name, replayed)
        else:
            push(replayed.value)

    def _dispatcher(self, inbound: int) -> Callable[[Any, bytes | None], None]:
        """Feed one input; a combine reading an exchange reuses the key bytes it arrived with."""
        spec = self.spec.inbound[inbound]
        combine: CombineOp | WindowedCombine | ProcessOp | None = None
        if len(spec.entries) == 1:
            combine = self.combines.get(spec.entries[0]) or self.processes.get(spec.entries[0])
        entry = self.entries[inbound]
        if combine is None or spec.entry_targets:
            return lambda elem, _kb: entry(elem)
        return self._adder(combine)

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
                write = combine.updates(reader, self.end.pane_emitter(combine))
            else:
                write = combine.updates(reader)
            if write:
                out[name] = write
        self.processes.updates(reader, out)  # runs the user's function on the chunk
        return out

    def closed_parts(self) -> int:
        """Window memberships dropped because that window had closed (sliding windows)."""
        return sum(c.closed_parts for c in self.combines.values() if isinstance(c, WindowedCombine))

    def chunk_committed(self) -> None:
        """The chunk is durable."""
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
        self.processes.fire(reader, timers, changes)  # timers due fire
        changes.update(self.end.flush_end(reader, timers))
        return changes

    # -- outputs -------------------------------------------------------------------------

    def take(self) -> list[Output]:
        """Encode everything buffered at the boundaries, deriving IDs when they are on."""
        return self.out.take()
