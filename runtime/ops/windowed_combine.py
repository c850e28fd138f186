"""Windowed combines on the executor: window state per key, and the panes it fires.

A windowed combine keeps, per key, the list of its open windows (one Redis hash field per
key, so a session merge rewrites one field in one commit): named records whose stored form
is :mod:`~.window_records`'; what happens to a key's windows (sessions merge, panes fire,
timers) is :mod:`~.window_panes`'.

* While chunks are committed (:meth:`WindowedCombine.updates`) records are added to their
  windows (sessions merge), and windows that take late records with ``late="record"`` fire
  a pane per record — all in the chunk's atomic commit, with the key's timers.
* At the end of the task (:meth:`WindowedCombine.fire`) every key touched by the batch or
  with a timer due (event time: the watermark passed a window's end or close; processing
  time: an early pane is due) is looked at once: panes fire and closed windows are dropped.
  Those changes are committed with the task's end-of-task outputs (``FINISH``), so a final
  pane and the deletion of its window's state happen together, and a replay of a finished
  task re-sends the backed-up panes instead of recomputing them.

Every decision uses the micro-batch's watermark and batch time, fixed by its first attempt,
so a retried task fires the same panes with the same IDs (``key, window, pane index``).

A lifted (partial) windowed combine runs before the exchange: it assigns windows and sends
one record per key, ``(key, [[start, end, accumulator, records, newest event time], ...])``
with every window the key's records fell in, so one partial per key crosses the shuffle (a
record per key and window would outnumber the input with sliding windows); sessions merge
within the partial too. The final combine also takes the older one-window form
``(key, [start, end, accumulator, records])`` that backups written before may hold.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from onceflow.kernel import codec
from onceflow.kernel.records import StateWrite
from onceflow.kernel.windows import GLOBAL_END, Late, Pane, Span, Timing, Windowing
from onceflow.runtime.combine_fn import CombineFn
from onceflow.runtime.ops.window_panes import (
    Emit,
    WindowClosedError,
    WindowPanes,
    closed_reason,
)
from onceflow.runtime.ops.window_records import (
    NO_TIME,
    Delta,
    KeyDeltas,
    KeyLate,
    LateRecord,
    Partial,
    PartialWindow,
    decode_entries,
    key_partials,
    merge_into,
    partial_windows,
)
from onceflow.runtime.spec import OpSpec, Phase

__all__ = ["WindowClosedError", "WindowedCombine", "closed_reason"]

StateReader = Callable[[str, Sequence[bytes]], Mapping[bytes, bytes | None]]


class WindowedCombine:
    """A windowed combine node of one task (see the module docstring)."""

    def __init__(
        self,
        spec: OpSpec,
        stateful: bool,
        chunked: bool,
        watermarks: tuple[int | None, int | None],
        now: int | None,
    ) -> None:
        assert spec.combine_fn is not None and spec.windowing is not None
        self.spec = spec
        self.fn: CombineFn = spec.combine_fn
        self.windowing: Windowing = spec.windowing
        self.stateful = stateful
        self.chunked = chunked
        self.merging = spec.phase is Phase.FINAL  # inputs are lifted partials
        # The batch's watermark fires windows; the batch before's decides which have closed
        # (None: bounded, nothing closes before the end).
        watermark, previous = watermarks
        self.watermark = previous if previous is not None else watermark
        self.now = now or 0
        self.per_record = stateful and self.windowing.trigger.late_mode is Late.RECORD
        self.acc: dict[bytes, KeyDeltas] = {}  # this chunk's deltas
        self.records: dict[bytes, KeyLate] = {}  # per-record late panes
        self.running: dict[bytes, KeyDeltas] = {}  # chunked partials: committed deltas
        self.touched: dict[bytes, Any] = {}  # keys changed by the batch
        self.pending: dict[bytes, Any] = {}
        self.closed_parts = 0  # memberships dropped because that window had closed
        self.failed: Callable[[Any, BaseException], None] = _reraise
        # Windows of a lifted partial that had closed, while others were open: a dead letter
        # of (reason, (key, those windows)).
        self.closed_windows: Callable[[str, Any], None] = _refuse
        # late-bound: the stage body sets ``failed`` after construction
        failed = lambda key, exc: self.failed(key, exc)  # noqa: E731, PLW0108
        self.panes = WindowPanes(self.fn, self.windowing, watermarks, self.now, failed)

    # -- adding ------------------------------------------------------------------------

    def _open_windows(self, ts: int, spans: list[Span]) -> list[Span]:
        """The spans still open at the watermark; raises when none is."""
        open_, dropped = self.panes.open_windows(ts, spans)
        self.closed_parts += dropped
        return open_

    def add(self, kb: bytes, key: Any, value: Any, ts: int) -> None:
        """Fold a value (or, after lifting, a partial: see :mod:`~.window_records`) in."""
        fn = self.fn
        if self.merging:
            if value and isinstance(value[0], list):  # one partial per key: its windows
                self._add_windows(kb, key, value)
                return
            start, end, acc, n = value  # one window (backups written before)
            spans = self._open_windows(ts, [(start, end)])
            self._put(kb, key, spans[0], acc, n, ts)
            return
        spans = self._open_windows(ts, self.windowing.fn.assign(ts))
        if self.per_record:
            for span in spans:
                self._record(kb, key, span, fn.add(fn.create(), value), 1, ts)
            return
        slot = self.acc.get(kb)
        if slot is None:
            slot = self.acc[kb] = KeyDeltas(key)
        windows = slot.windows
        for span in spans:
            entry = windows.get(span)
            if entry is None:
                windows[span] = Delta(fn.add(fn.create(), value), 1, ts)
                continue
            entry.acc = (
                fn.add(fn.create(), value) if entry.acc is None else fn.add(entry.acc, value)
            )
            entry.records += 1
            entry.newest = max(entry.newest, ts)

    def _add_windows(self, kb: bytes, key: Any, windows: list[list[Any]]) -> None:
        """A lifted partial's windows; those that have closed go to dead letters."""
        wm = self.watermark
        closed = []
        for window in windows:
            w = PartialWindow(*window)
            if wm is not None and self.windowing.closed(w.end, wm):
                closed.append(window)
            else:
                self._put(kb, key, (w.start, w.end), w.acc, w.records, w.newest)
        if closed:
            assert wm is not None
            parts = [PartialWindow(*w) for w in closed]
            newest = max(w.newest for w in parts)
            reason = closed_reason(
                newest, [(w.start, w.end) for w in parts], wm, self.windowing.allowed_lateness_ms
            )
            if len(closed) == len(windows):
                raise WindowClosedError(reason)
            self.closed_windows(reason, (key, closed))

    def _put(self, kb: bytes, key: Any, span: Span, acc: Any, n: int, ts: int) -> None:
        if self.per_record:
            self._record(kb, key, span, acc, n, ts)
            return
        slot = self.acc.get(kb)
        if slot is None:
            slot = self.acc[kb] = KeyDeltas(key)
        entry = slot.windows.get(span)
        if entry is None:
            entry = slot.windows[span] = Delta(None, 0, NO_TIME)
        entry.merge(acc, n, ts, self.fn.merge)

    def _record(self, kb: bytes, key: Any, span: Span, acc: Any, n: int, ts: int) -> None:
        slot = self.records.get(kb)
        if slot is None:
            slot = self.records[kb] = KeyLate(key)
        slot.late.append(LateRecord(span, acc, n, ts))

    def touch(self, kb: bytes, key: Any, ts: int) -> None:  # noqa: ARG002 - CombineOp's API
        """A key whose records an earlier attempt of this task committed."""
        self.touched.setdefault(kb, key)

    # -- partial (lifted) ----------------------------------------------------------------

    def partials(self, source: dict[bytes, KeyDeltas]) -> list[Partial]:
        """``(key bytes, key, newest, wire windows)`` per key (see :func:`key_partials`)."""
        return key_partials(source, self.windowing.fn.merging, self.fn.merge)

    def seed(self, kb: bytes, value: bytes, ts: int) -> None:
        """Merge a committed partial (this attempt's, or replayed from backup) into the sum."""
        slot = self.running.get(kb)
        if slot is None:
            slot = self.running[kb] = KeyDeltas(codec.decode(kb))
        for w in partial_windows(codec.decode(value), ts):
            delta = Delta(w.acc, w.records, w.newest)
            merge_into(slot.windows, (w.start, w.end), delta, self.fn.merge)

    def deltas(self) -> list[tuple[bytes, int, bytes]]:
        """This chunk's partials, encoded, to back up with the chunk."""
        return [
            (kb, newest, codec.encode(partial))
            for kb, _key, newest, partial in self.partials(self.acc)
        ]

    def drain(self) -> list[Partial]:
        """Everything a partial accumulated, for the end-of-task flush."""
        if self.chunked:
            self._keep_chunk()
            out = self.partials(self.running)
            self.running = {}
        else:
            out = self.partials(self.acc)
        self.acc = {}
        return out

    def _keep_chunk(self) -> None:
        """A partial's committed chunk joins its running sums (sessions merge at the end)."""
        for kb, slot in self.acc.items():
            running = self.running.get(kb)
            if running is None:
                running = self.running[kb] = KeyDeltas(slot.key)
            for span, delta in slot.windows.items():
                merge_into(running.windows, span, delta, self.fn.merge)
        self.acc = {}

    # -- stateful (streaming) ----------------------------------------------------------

    def updates(self, reader: StateReader, emit: Emit) -> StateWrite:
        """New state for every key with records in this chunk (and per-record late panes)."""
        keys = list(dict.fromkeys([*self.acc, *self.records]))
        if not keys:
            return StateWrite()
        current = reader(self.spec.name, keys)
        write = StateWrite()
        panes = self.panes
        for kb in keys:
            slot = self.acc.get(kb)
            late = self.records.get(kb)
            key = slot.key if slot is not None else late.key  # type: ignore[union-attr]
            entries = decode_entries(current.get(kb))
            if slot is not None:
                if self.windowing.fn.merging:
                    for span, d in slot.windows.items():
                        entries = panes.apply(entries, span, d.acc, d.records, d.newest)
                else:
                    panes.apply_all(entries, slot.windows)
            if late is not None:
                for r in late.late:
                    entries = panes.apply(entries, r.span, r.acc, r.records, r.ts)
                    panes.late_panes(kb, key, entries, emit)
            panes.write(write, kb, entries)
            self.pending[kb] = key
        return write

    def chunk_committed(self) -> None:
        """The chunk is durable: its keys count as touched."""
        for kb, key in self.pending.items():
            self.touched.setdefault(kb, key)
        self.pending.clear()
        if self.chunked:
            self._keep_chunk()
        self.acc.clear()
        self.records.clear()

    def reset_chunk(self) -> None:
        """Forget the chunk (its commit was refused; it will be redone)."""
        self.pending.clear()
        self.acc.clear()
        self.records.clear()

    def fire(self, reader: StateReader, due: Sequence[bytes], emit: Emit) -> StateWrite:
        """End of task: fire the panes that are due and drop closed windows."""
        keys = list(dict.fromkeys([*self.touched, *due]))
        write = StateWrite()
        if not keys:
            return write
        current = reader(self.spec.name, keys)
        settle = self.panes.settle
        for kb in sorted(keys):
            raw = current.get(kb)
            if raw is None:
                continue
            key = self.touched.get(kb)
            if key is None:
                key = codec.decode(kb)
            entries = [e for e in decode_entries(raw) if not settle(kb, key, e, emit)]
            self.panes.write(write, kb, entries)
        self.touched.clear()
        return write

    # -- bounded -------------------------------------------------------------------------

    def final_panes(self) -> list[tuple[bytes, Any, Pane, int]]:
        """Bounded runs: one final pane per window at the end of the input."""
        out = []
        for kb, key, _newest, windows in self.partials(self.acc):
            for start, end, acc, _n, newest in windows:
                try:
                    value = self.fn.extract(acc)
                except Exception as exc:  # noqa: BLE001 - user code: a dead letter
                    self.failed(key, exc)
                    continue
                pane = Pane(value, start, end, Timing.ON_TIME.value, 0, True)
                out.append((kb, key, pane, end - 1 if end < GLOBAL_END else newest))
        self.acc.clear()
        return out


def _reraise(key: Any, exc: BaseException) -> None:  # noqa: ARG001 - the default handler
    raise exc


def _refuse(reason: str, part: Any) -> None:  # noqa: ARG001 - the default handler
    raise WindowClosedError(reason)
