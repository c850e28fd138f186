"""Executor side: the ops of one fused stage, wired push-style.

Every element is pushed through the stage's ops; what reaches a boundary (a port, a sink or
the dead-letter output) is buffered with its parent's ID and timestamp. :meth:`StageBody.take`
then encodes the buffered elements and, with IDs on, derives each output's ID from its parent,
the boundary's name and its index among that parent's outputs on that boundary.

Combines fold per key. In a bounded run a combine holds its accumulators for the whole task.
In a streaming run a full or final combine is *stateful*: each chunk's per-key deltas are
merged into state kept by the runtime (Redis), and at the end of the task the new value of
every key touched by the batch is emitted. Partial combines flush per chunk when IDs are on
(their output must be committed with the chunk's input) and once per task otherwise.
Windowed combines (:mod:`onceflow.runtime.windowing`) emit panes instead, when their
trigger says so; a record whose windows have all closed becomes a dead letter.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from onceflow.kernel import codec
from onceflow.kernel.errors import CodecError
from onceflow.kernel.ids import Deriver
from onceflow.kernel.records import DeadLetter, Guarantee, InRow, Output, Redrive, StateWrite
from onceflow.kernel.windows import Pane
from onceflow.runtime.errors import RuntimeFailure
from onceflow.runtime.spec import OpKind, OpSpec, Phase, StageSpec, TargetKind, TargetSpec
from onceflow.runtime.windowing import WindowClosedError, WindowedCombine

Push = Callable[[Any], None]
# Part of the IDs of partial accumulators flushed at the end of a task (a data format: keep).
PARTIAL_FLUSH = "end"
StateReader = Callable[[str, Sequence[bytes]], Mapping[bytes, bytes | None]]
# Keys of a combine node whose timers are due: (node, watermark, batch time) -> keys
TimerReader = Callable[[str, int, int], Sequence[bytes]]
EXPIRY_TIMERS = "expiry"


class StageFailure(RuntimeFailure):
    """User code failed and the pipeline is set to fail rather than dead-letter."""


class Cursor:
    """The parent record whose outputs are being produced, shared by a stage's ops."""

    __slots__ = ("parent", "ts")

    def __init__(self) -> None:
        self.parent = b""
        self.ts = 0


def describe(value: Any, limit: int = 500) -> str:
    """A bounded printable form of a value, for dead letters."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the real error
        text = f"<unprintable {type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


def portable(value: Any, limit: int = 1 << 20) -> str:
    """A value as JSON when it is JSON-friendly (so it can be sent again), else printable."""
    return as_json(value, limit)[0]


def as_json(value: Any, limit: int = 1 << 20) -> tuple[str, bool]:
    """``(JSON, True)`` for a JSON-friendly value (it can be replayed), else a printed form."""
    try:
        return json.dumps(value), True
    except (TypeError, ValueError):
        return describe(value, limit), False


def too_large(limit: int) -> str:
    """The end of every reason a record too large to process gives."""
    return (
        f"the limit is {limit} bytes (Pipeline max_record_bytes): it is not processed; "
        "raise max_record_bytes, or make records smaller"
    )


def error_text(exc: BaseException) -> str:
    """``Type: message`` plus the innermost user frame, for dead letters."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


class CombineOp:
    """Per-key accumulators of one combine node.

    With a time-to-live, a stateful combine stores ``[accumulator, expiry]`` and treats a key
    whose expiry (batch time) has passed as new; ``onceflow gc`` deletes such keys.
    """

    def __init__(self, spec: OpSpec, stateful: bool, chunked: bool, now: int | None) -> None:
        assert spec.combine_fn is not None
        self.spec = spec
        self.fn = spec.combine_fn
        self.stateful = stateful
        self.chunked = chunked  # a partial whose per-chunk deltas are committed with the chunk
        self.merging = spec.phase is Phase.FINAL
        self.ttl_ms = spec.ttl_ms if stateful else None
        self.now = now or 0
        self.acc: dict[bytes, list[Any]] = {}  # key bytes -> [key, accumulator, max ts]
        self.running: dict[bytes, list[Any]] = {}  # chunked: deltas of committed chunks
        self.touched: dict[bytes, list[Any]] = {}  # stateful: keys changed by this batch
        self.pending: dict[bytes, list[Any]] = {}

    def add(self, kb: bytes, key: Any, value: Any, ts: int) -> None:
        """Fold one value (or, after lifting, one accumulator) into the key's accumulator."""
        entry = self.acc.get(kb)
        fn = self.fn
        if entry is None:
            acc = value if self.merging else fn.add(fn.create(), value)
            self.acc[kb] = [key, acc, ts]
            return
        entry[1] = fn.merge(entry[1], value) if self.merging else fn.add(entry[1], value)
        entry[2] = max(entry[2], ts)

    def touch(self, kb: bytes, key: Any, ts: int) -> None:
        """Remember a key whose effect was committed earlier (a replayed record)."""
        entry = self.touched.get(kb)
        if entry is None:
            self.touched[kb] = [key, ts]
        elif ts > entry[1]:
            entry[1] = ts

    def stored(self, raw: bytes | None) -> Any:
        """The accumulator in a stored value (None: no state, or it expired)."""
        if raw is None:
            return None
        value = codec.decode(raw)
        if self.ttl_ms is None:
            return value
        acc, expiry = value
        return None if expiry <= self.now else acc

    def updates(self, reader: StateReader) -> StateWrite:
        """New encoded state for every key with a delta in this chunk."""
        write = StateWrite()
        if not self.acc:
            return write
        current = reader(self.spec.name, list(self.acc))
        expiry = self.now + self.ttl_ms if self.ttl_ms is not None else None
        timers: dict[bytes, int | None] = {}
        for kb, (key, delta, ts) in self.acc.items():
            old = self.stored(current.get(kb))
            new = delta if old is None else self.fn.merge(old, delta)
            if expiry is None:
                write.values[kb] = codec.encode(new)
            else:
                write.values[kb] = codec.encode([new, expiry])
                timers[kb] = expiry
            self.pending[kb] = [key, ts]
        if timers:
            write.timers[EXPIRY_TIMERS] = timers
        return write

    def chunk_committed(self) -> None:
        """The chunk is durable: its keys count as touched, its deltas join the running sum."""
        for kb, (key, ts) in self.pending.items():
            self.touch(kb, key, ts)
        self.pending.clear()
        if self.chunked:
            for kb, (key, acc, ts) in self.acc.items():
                self.seed(kb, key, acc, ts)
        self.acc.clear()

    def reset_chunk(self) -> None:
        """Forget the chunk's deltas (its commit was refused and it will be redone)."""
        self.pending.clear()
        self.acc.clear()

    def seed(self, kb: bytes, key: Any, acc: Any, ts: int) -> None:
        """Merge a committed delta (of this attempt, or replayed from backup) into the sum."""
        entry = self.running.get(kb)
        if entry is None:
            self.running[kb] = [key, acc, ts]
            return
        entry[1] = self.fn.merge(entry[1], acc)
        entry[2] = max(entry[2], ts)

    def drain(self) -> dict[bytes, list[Any]]:
        """Everything accumulated, for the end-of-task flush; leaves the combine empty."""
        if self.chunked:
            for kb, (key, acc, ts) in self.acc.items():
                self.seed(kb, key, acc, ts)
            out, self.running = self.running, {}
        else:
            out = self.acc
        self.acc = {}
        return out


class StageBody:
    """The ops of one stage for one task."""

    def __init__(
        self,
        spec: StageSpec,
        mode: Guarantee,
        batch: int,
        partition: int,
        watermark: int | None = None,
        now: int | None = None,
    ) -> None:
        self.spec = spec
        self.mode = mode
        self.batch = batch
        self.partition = partition
        self.watermark = watermark  # the micro-batch's (None: bounded)
        self.now = now  # the micro-batch's time (None: bounded)
        self.cursor = Cursor()
        self.buffers: list[list[tuple[bytes, int, Any]]] = [[] for _ in spec.targets]
        self.derivers = [Deriver(t.name) if mode.ids else None for t in spec.targets]
        self.combines: dict[str, CombineOp | WindowedCombine] = {}
        self.op_derivers: dict[str, Deriver] = {}
        self.dead_count = 0
        self.dead_codes: dict[str, int] = {}  # dead letters by reason (DeadLetter.code)
        self.origins: dict[bytes, str] = {}  # source records: where they were read
        self.push: dict[str, Push] = {}
        for op in reversed(spec.ops):  # consumers first, so producers can bind them
            self.push[op.name] = self._build(op)
        self.entries = [self._entry(i.entries, i.entry_targets) for i in spec.inbound]
        self.dispatch = [self._dispatcher(i.index) for i in spec.inbound]

    # -- wiring --------------------------------------------------------------------------

    def _downstream(self, op: OpSpec) -> list[Push]:
        return [self.push[n] for n in op.to_ops] + [self._appender(t) for t in op.to_targets]

    def _appender(self, target: int) -> Push:
        buf = self.buffers[target]
        cursor = self.cursor

        def append(elem: Any) -> None:
            buf.append((cursor.parent, cursor.ts, elem))

        return append

    def _fan_out(self, pushes: list[Push]) -> Push:
        if len(pushes) == 1:
            return pushes[0]

        def fan(elem: Any) -> None:
            for p in pushes:
                p(elem)

        return fan

    def _build(self, op: OpSpec) -> Push:
        if op.kind is OpKind.COMBINE:
            return self._build_combine(op)
        return self._build_flat_map(op)

    def _build_flat_map(self, op: OpSpec) -> Push:
        assert op.fn is not None
        fn = op.fn
        out = self._fan_out(self._downstream(op))
        cursor = self.cursor
        fail = self._fail
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

    def _build_combine(self, op: OpSpec) -> Push:
        stateful = self.mode.streaming and op.phase is not Phase.PARTIAL
        chunked = self.mode.ids and op.phase is Phase.PARTIAL
        combine: CombineOp | WindowedCombine
        if op.windowing is not None:
            combine = WindowedCombine(op, stateful, chunked, self.watermark, self.now)
        else:
            combine = CombineOp(op, stateful, chunked, self.now)
        self.combines[op.name] = combine
        if self.mode.ids:
            self.op_derivers[op.name] = Deriver(op.name)
        return self._adder(combine)

    def _adder(self, combine: CombineOp | WindowedCombine) -> Callable[..., None]:
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
                key, value = elem
                combine.add(kb if kb is not None else encode(key), key, value, cursor.ts)
            except WindowClosedError as late:
                closed(name, str(late), elem)
            except Exception as exc:  # noqa: BLE001 - user code or a bad element
                fail(name, exc, elem)

        return push

    def _window_closed(self, node: str, reason: str, elem: Any) -> None:
        """A record too late for every one of its windows: a dead letter, never dropped."""
        letter = DeadLetter(
            self.cursor.parent,
            self.cursor.ts,
            node,
            reason,
            self._origin(),
            None,
            portable(elem),
            "window_closed",
        )
        self.dead(letter)

    def _entry(self, ops: tuple[str, ...], targets: tuple[int, ...]) -> Push:
        return self._fan_out([self.push[n] for n in ops] + [self._appender(t) for t in targets])

    def _fail(self, node: str, exc: BaseException, elem: Any) -> None:
        if self.spec.on_error == "fail":
            msg = f"stage {node!r} failed on {describe(elem, 200)}: {error_text(exc)}"
            raise StageFailure(msg) from exc
        value, replayable = as_json(elem)
        letter = DeadLetter(
            self.cursor.parent,
            self.cursor.ts,
            node,
            error_text(exc),
            self._origin(),
            None,
            value,
            "user_error",
            json_value=replayable,
        )
        self.dead(letter)

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
        self.dead_count, codes, closed = saved
        self.dead_codes = dict(codes)
        for name, n in closed.items():
            self.combines[name].closed_parts = n  # type: ignore[union-attr]

    def dead(self, letter: DeadLetter) -> None:
        """Send a dead letter to the stage's dead-letter output."""
        self.dead_count += 1
        self.dead_codes[letter.code] = self.dead_codes.get(letter.code, 0) + 1
        self.buffers[self.spec.dead_target].append((letter.id, letter.ts, letter))

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
        if push is not None:
            push(replayed.value)
            return
        reason = (
            f"a replayed dead letter names node {replayed.node!r}, which stage "
            f"{self.spec.name!r} does not run (the pipeline changed, or the letter came from "
            "a stage after a shuffle): send its value to the pipeline's input yourself"
        )
        letter = DeadLetter(
            self.cursor.parent,
            self.cursor.ts,
            self.spec.name,
            reason,
            self._origin(),
            None,
            portable(replayed.value),
            "not_replayable",
        )
        self.dead(letter)

    def _dispatcher(self, inbound: int) -> Callable[[Any, bytes | None], None]:
        """Feed one input; a combine reading an exchange reuses the key bytes it arrived with."""
        spec = self.spec.inbound[inbound]
        combine = self.combines.get(spec.entries[0]) if len(spec.entries) == 1 else None
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
        """This chunk's partial-combine deltas, as outputs to back up with the chunk.

        They are not sent anywhere: a partial combine emits once per task (so lifting stays
        effective), and a retried task re-seeds its sums from these backed-up deltas.
        Targets are negative: ``-1 - position of the op``.
        """
        out: list[Output] = []
        for position, op in enumerate(self.spec.ops):
            combine = self.combines.get(op.name)
            if combine is None or not combine.chunked:
                continue
            if isinstance(combine, WindowedCombine):
                for kb, ts, value in combine.deltas():
                    out.append(Output(-1 - position, b"", ts, kb, value))
                continue
            for kb, (_key, acc, ts) in combine.acc.items():
                out.append(Output(-1 - position, b"", ts, kb, codec.encode(acc)))
        return out

    def seed_partials(self, outputs: list[Output]) -> None:
        """Re-seed partial sums from deltas an earlier attempt committed."""
        for out in outputs:
            combine = self.combines[self.spec.ops[-1 - out.target].name]
            assert out.key is not None
            if isinstance(combine, WindowedCombine):
                combine.seed(out.key, out.value, out.ts)
            else:
                combine.seed(out.key, codec.decode(out.key), codec.decode(out.value), out.ts)

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
                write = combine.updates(reader, self._pane_emitter(combine))
            else:
                write = combine.updates(reader)
            if write:
                out[name] = write
        return out

    def closed_parts(self) -> int:
        """Window memberships dropped because that window had closed (sliding windows)."""
        return sum(c.closed_parts for c in self.combines.values() if isinstance(c, WindowedCombine))

    def chunk_committed(self) -> None:
        """The chunk is durable."""
        for combine in self.combines.values():
            if combine.stateful or combine.chunked:
                combine.chunk_committed()

    def reset_chunk(self) -> None:
        """Drop everything the chunk produced (its commit was refused; it will be redone)."""
        for buf in self.buffers:
            buf.clear()
        for combine in self.combines.values():
            if combine.stateful or combine.chunked:
                combine.reset_chunk()

    def flush_end(
        self, reader: StateReader | None, timers: TimerReader | None = None
    ) -> dict[str, StateWrite]:
        """End of task: emit combine results, in graph order.

        Returns the state changes of windowed combines (panes fired, windows closed): they
        are committed with the task's end-of-task outputs.
        """
        changes: dict[str, StateWrite] = {}
        for op in self.spec.ops:
            combine = self.combines.get(op.name)
            if combine is None:
                continue
            if isinstance(combine, WindowedCombine):
                write = self._flush_windows(combine, reader, timers)
                if write:
                    changes[op.name] = write
            elif combine.stateful:
                assert reader is not None
                self._emit_state(combine, reader)
            elif op.phase is Phase.PARTIAL:
                self._emit_accumulators(combine)
            else:
                self._emit_results(combine)
        return changes

    def _flush_windows(
        self, combine: WindowedCombine, reader: StateReader | None, timers: TimerReader | None
    ) -> StateWrite | None:
        if combine.stateful:
            assert reader is not None and timers is not None
            wm = self.watermark if self.watermark is not None else 0
            due = timers(combine.spec.name, wm, self.now or 0)
            return combine.fire(reader, due, self._pane_emitter(combine))
        if combine.spec.phase is Phase.PARTIAL:
            out = self._fan_out(self._downstream(combine.spec))
            deriver = self.op_derivers.get(combine.spec.name)
            cursor = self.cursor
            for kb, key, ts, partial in combine.drain():
                if deriver is not None:
                    cursor.parent = deriver.of(self.batch, self.partition, PARTIAL_FLUSH, kb)
                cursor.ts = ts
                out((key, partial))
            return None
        emit = self._pane_emitter(combine)  # (sets combine.failed before extract runs)
        for kb, key, pane, ts in combine.final_panes():
            emit(kb, key, pane, ts)
        return None

    def _pane_emitter(self, combine: WindowedCombine) -> Callable[[bytes, Any, Pane, int], None]:
        """Send ``(key, pane)`` on, its ID derived from key, window and pane index."""
        out = self._fan_out(self._downstream(combine.spec))
        deriver = self.op_derivers.get(combine.spec.name)
        cursor = self.cursor
        name = combine.spec.name
        combine.failed = lambda key, exc: self._fail(name, exc, key)

        def emit(kb: bytes, key: Any, pane: Pane, ts: int) -> None:
            if deriver is not None:
                cursor.parent = deriver.of(kb, pane.start, pane.end, pane.index)
            cursor.ts = ts
            out((key, pane))

        return emit

    def _emit_accumulators(self, combine: CombineOp) -> None:
        out = self._fan_out(self._downstream(combine.spec))
        deriver = self.op_derivers.get(combine.spec.name)
        cursor = self.cursor
        for kb, (key, acc, ts) in combine.drain().items():
            if deriver is not None:
                cursor.parent = deriver.of(self.batch, self.partition, PARTIAL_FLUSH, kb)
            cursor.ts = ts
            out((key, acc))

    def _emit_results(self, combine: CombineOp) -> None:
        out = self._fan_out(self._downstream(combine.spec))
        cursor = self.cursor
        fn = combine.fn
        for key, acc, ts in combine.acc.values():
            cursor.ts = ts
            try:
                result = fn.extract(acc)
            except Exception as exc:  # noqa: BLE001 - user code
                self._fail(combine.spec.name, exc, (key, acc))
                continue
            out((key, result))
        combine.acc.clear()

    def _emit_state(self, combine: CombineOp, reader: StateReader) -> None:
        if not combine.touched:
            return
        out = self._fan_out(self._downstream(combine.spec))
        deriver = self.op_derivers.get(combine.spec.name)
        cursor = self.cursor
        values = reader(combine.spec.name, list(combine.touched))
        for kb, (key, ts) in combine.touched.items():
            raw = values.get(kb)
            if raw is None:
                continue
            if deriver is not None:
                cursor.parent = deriver.of(self.batch, kb)
            cursor.ts = ts
            try:
                acc = combine.stored(raw)
                result = combine.fn.extract(acc if acc is not None else combine.fn.create())
            except Exception as exc:  # noqa: BLE001 - user code
                self._fail(combine.spec.name, exc, key)
                continue
            out((key, result))
        combine.touched.clear()

    # -- outputs -------------------------------------------------------------------------

    def take(self) -> list[Output]:
        """Encode everything buffered at the boundaries, deriving IDs when they are on."""
        outputs: list[Output] = []
        for target in self.spec.targets:  # the dead-letter target is last: it collects
            buf = self.buffers[target.index]  # encoding failures of the others
            if buf:
                self._encode_target(target, buf, outputs)
                buf.clear()
        return outputs

    def _encode_target(
        self, target: TargetSpec, buf: list[tuple[bytes, int, Any]], outputs: list[Output]
    ) -> None:
        deriver = self.derivers[target.index]
        dead = target.kind is TargetKind.DEAD
        keyed = target.keyed and not dead
        limit = self.spec.max_record_bytes
        index = target.index
        prev = None
        n = 0
        for parent, ts, elem in buf:
            if deriver is None:
                rid = b""
            else:
                n = n + 1 if parent == prev else 0
                prev = parent
                rid = deriver.child(parent, n)
            try:
                if dead:
                    key, value = None, codec.encode(elem.to_element(limit))
                elif keyed:
                    k, v = elem
                    key, value = codec.encode(k), codec.encode(v)
                else:
                    key, value = None, codec.encode(elem)
            except (CodecError, TypeError, ValueError) as exc:
                self._boundary_dead(target, parent, ts, elem, exc, dead)
                continue
            size = len(value) + (len(key) if key is not None else 0)
            if size > limit and not dead:  # a dead letter is never dropped (its payload is cut)
                self._too_large(target, parent, ts, elem, size, limit)
                continue
            outputs.append(Output(index, rid, ts, key, value))

    def _too_large(
        self, target: TargetSpec, parent: bytes, ts: int, elem: Any, size: int, limit: int
    ) -> None:
        """An output over ``max_record_bytes``: a dead letter of its input (or a stop)."""
        reason = f"an output for {target.name!r} is {size} bytes encoded; {too_large(limit)}"
        if self.spec.on_error == "fail":
            raise StageFailure(reason)
        letter = DeadLetter(
            parent, ts, target.name, reason, self._origin(), None, describe(elem), "too_large"
        )
        self.dead(letter)

    def _boundary_dead(
        self, target: TargetSpec, parent: bytes, ts: int, elem: Any, exc: Exception, dead: bool
    ) -> None:
        if dead:  # a dead letter that cannot be encoded: keep its text only
            msg = f"cannot encode a dead letter of {target.name}: {exc}"
            raise RuntimeFailure(msg) from exc
        if self.spec.on_error == "fail":
            msg = f"output of {target.name!r} cannot be written: {exc}"
            raise StageFailure(msg) from exc
        reason = f"cannot send to {target.name!r}: {exc}"
        if target.keyed and not (isinstance(elem, tuple) and len(elem) == 2):
            reason = f"{target.name!r} expects (key, value) pairs, got {describe(elem, 80)}"
        letter = DeadLetter(
            parent, ts, target.name, reason, self._origin(), None, describe(elem), "unwritable"
        )
        self.dead(letter)
