"""End of a task: combine results, partial accumulators and window panes sent on.

In graph order, every combine of the stage emits what the end of the task makes due: a
stateful combine the new value of every key the batch touched, a partial its accumulators
(once per task, so lifting stays effective), a bounded combine its results, a windowed one
its panes (:mod:`~.windowed_combine`). Outputs get IDs derived from what makes them
(batch, partition and key; key, window and pane index), so a retry makes the same ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from itertools import repeat
from typing import Any

from onceflow.kernel import codec
from onceflow.kernel.errors import CodecError
from onceflow.kernel.ids import Deriver
from onceflow.kernel.records import Output, StateWrite, outputs_of
from onceflow.kernel.windows import Pane
from onceflow.runtime.ops.combine import CombineOp, StateReader
from onceflow.runtime.ops.record_text import Cursor
from onceflow.runtime.ops.windowed_combine import WindowedCombine
from onceflow.runtime.spec import OpSpec, Phase, StageSpec

Push = Callable[[Any], None]
# Part of the IDs of partial accumulators flushed at the end of a task (a data format: keep).
PARTIAL_FLUSH = "end"
# Part of the IDs of the deletes a key's expiry sends (a data format: keep).
EXPIRED = "expired"
# Keys of a combine node whose timers are due: (node, watermark, batch time) -> keys
TimerReader = Callable[[str, int, int], Sequence[bytes]]
Fail = Callable[[str, BaseException, Any], None]
Combines = Mapping[str, CombineOp | WindowedCombine]


class CombineFlush:
    """Emits a stage's combine outputs at the end of a task (see the module docstring)."""

    def __init__(
        self,
        spec: StageSpec,
        combines: Mapping[str, CombineOp | WindowedCombine],
        op_derivers: Mapping[str, Deriver],
        cursor: Cursor,
        where: tuple[int, int, int | None, int | None],
        outlet: Callable[[OpSpec], Push],
        fail: Fail,
        step: Callable[[], AbstractContextManager[None]],
    ) -> None:
        self.spec = spec
        self.combines = combines
        self.op_derivers = op_derivers
        self.cursor = cursor
        # the task's batch and partition, the micro-batch's watermark and time (None: bounded)
        self.batch, self.partition, self.watermark, self.now = where
        self.outlet = outlet  # what an op's outputs go to
        self.fail = fail
        self.step = step  # what a combine emits in it runs on through the stage at its end

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
            with self.step():
                write = self._flush(op, combine, reader, timers)
            if write:
                changes[op.name] = write
        return changes

    def _flush(
        self,
        op: OpSpec,
        combine: CombineOp | WindowedCombine,
        reader: StateReader | None,
        timers: TimerReader | None,
    ) -> StateWrite | None:
        """Emit what one combine makes due at the end of the task."""
        if isinstance(combine, WindowedCombine):
            return self._flush_windows(combine, reader, timers)
        if combine.stateful:
            assert reader is not None
            self._emit_state(combine, reader)
            if combine.spec.expiry_deletes and timers is not None:
                return self._emit_expired(combine, reader, timers)
        elif op.phase is Phase.PARTIAL:
            self._emit_accumulators(combine)
        else:
            self._emit_results(combine)
        return None

    def _flush_windows(
        self, combine: WindowedCombine, reader: StateReader | None, timers: TimerReader | None
    ) -> StateWrite | None:
        if combine.stateful:
            assert reader is not None and timers is not None
            wm = self.watermark if self.watermark is not None else 0
            due = timers(combine.spec.name, wm, self.now or 0)
            return combine.fire(reader, due, self.pane_emitter(combine))
        if combine.spec.phase is Phase.PARTIAL:
            out = self.outlet(combine.spec)
            deriver = self.op_derivers.get(combine.spec.name)
            cursor = self.cursor
            for kb, key, ts, partial in combine.drain():
                if deriver is not None:
                    cursor.parent = deriver.of(self.batch, self.partition, PARTIAL_FLUSH, kb)
                cursor.ts = ts
                out((key, partial))
            return None
        emit = self.pane_emitter(combine)  # (sets combine.failed before extract runs)
        for kb, key, pane, ts in combine.final_panes():
            emit(kb, key, pane, ts)
        return None

    def pane_emitter(self, combine: WindowedCombine) -> Callable[[bytes, Any, Pane, int], None]:
        """Send ``(key, pane)`` on, its ID derived from key, window and pane index."""
        out = self.outlet(combine.spec)
        deriver = self.op_derivers.get(combine.spec.name)
        cursor = self.cursor
        name = combine.spec.name
        combine.failed = lambda key, exc: self.fail(name, exc, key)

        def emit(kb: bytes, key: Any, pane: Pane, ts: int) -> None:
            if deriver is not None:
                cursor.parent = deriver.of(kb, pane.start, pane.end, pane.index)
            cursor.ts = ts
            out((key, pane))

        return emit

    def _emit_accumulators(self, combine: CombineOp) -> None:
        out = self.outlet(combine.spec)
        deriver = self.op_derivers.get(combine.spec.name)
        cursor = self.cursor
        for kb, (key, acc, ts) in combine.drain().items():
            if deriver is not None:
                cursor.parent = deriver.of(self.batch, self.partition, PARTIAL_FLUSH, kb)
            cursor.ts = ts
            out((key, acc))

    def _emit_results(self, combine: CombineOp) -> None:
        out = self.outlet(combine.spec)
        cursor = self.cursor
        fn = combine.fn
        for key, acc, ts in combine.acc.values():
            cursor.ts = ts
            try:
                result = fn.extract(acc)
            except Exception as exc:  # noqa: BLE001 - user code
                self.fail(combine.spec.name, exc, (key, acc))
                continue
            out((key, result))
        combine.acc.clear()

    def _emit_state(self, combine: CombineOp, reader: StateReader) -> None:
        if not combine.touched:
            return
        out = self.outlet(combine.spec)
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
                self.fail(combine.spec.name, exc, key)
                continue
            out((key, result))
        combine.touched.clear()

    def _emit_expired(
        self, combine: CombineOp, reader: StateReader, timers: TimerReader
    ) -> StateWrite | None:
        """``(key, None)`` for every key whose state expired; the state deleted with it.

        Committed with the task's end-of-task step: a retry before it finds the same keys
        and sends the same deletes (IDs from batch, key and :data:`EXPIRED`), after it none.
        """
        wm = self.watermark if self.watermark is not None else 0
        due = timers(combine.spec.name, wm, self.now or 0)
        gone, write = combine.expired(reader, due)
        out = self.outlet(combine.spec)
        deriver = self.op_derivers.get(combine.spec.name)
        cursor = self.cursor
        for kb in gone:
            if deriver is not None:
                cursor.parent = deriver.of(self.batch, kb, EXPIRED)
            cursor.ts = max(wm, 0)
            out((codec.decode(kb), None))
        return write if gone else None


def chunk_deltas(spec: StageSpec, combines: Combines) -> list[Output]:
    """This chunk's partial-combine deltas, as outputs to back up with the chunk.

    They are not sent anywhere: a partial combine emits once per task (so lifting stays
    effective), and a retried task re-seeds its sums from these backed-up deltas.
    Targets are negative: ``-1 - position of the op``.
    """
    out: list[Output] = []
    for position, op in enumerate(spec.ops):
        combine = combines.get(op.name)
        if combine is None or not combine.chunked:
            continue
        if isinstance(combine, WindowedCombine):
            for kb, ts, value in combine.deltas():
                out.append(Output(-1 - position, b"", ts, kb, value))
            continue
        entries = list(combine.acc.values())
        accs = [e[1] for e in entries]
        try:
            encoded = codec.encode_many(accs)
        except CodecError:  # one by one: the error says which
            encoded = [codec.encode(acc) for acc in accs]
        n = len(entries)
        stamps = [e[2] for e in entries]
        out += outputs_of(repeat(-1 - position, n), repeat(b"", n), stamps, combine.acc, encoded)
    return out


def seed_partials(spec: StageSpec, combines: Combines, outputs: list[Output]) -> None:
    """Re-seed partial sums from deltas an earlier attempt committed."""
    for out in outputs:
        combine = combines[spec.ops[-1 - out.target].name]
        assert out.key is not None
        if isinstance(combine, WindowedCombine):
            combine.seed(out.key, out.value, out.ts)
        else:
            combine.seed(out.key, codec.decode(out.key), codec.decode(out.value), out.ts)
