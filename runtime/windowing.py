"""Windowed combines on the executor: window state per key, and the panes it fires.

A windowed combine keeps, per key, the list of its open windows (one Redis hash field per
key, so a session merge rewrites one field in one commit). Each window entry is
``[start, end, accumulator, records since the last pane, panes fired, end passed,
batch time of the pane's first record, newest event time]``; the accumulator is ``None``
after a discarding pane.

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
from onceflow.kernel.windows import GLOBAL_END, Late, Pane, Span, Timing, Windowing, merge_spans
from onceflow.runtime.combine_fn import CombineFn
from onceflow.runtime.spec import OpSpec, Phase

# Fields of a window entry.
START, END, ACC, SINCE, INDEX, PASSED, FIRST, NEWEST = range(8)
# Timer kinds (one sorted set each per combine node and partition).
EVENT_TIMERS = "event"
PROCESSING_TIMERS = "processing"
NO_TIME = -(1 << 62)

StateReader = Callable[[str, Sequence[bytes]], Mapping[bytes, bytes | None]]
Emit = Callable[[bytes, Any, Pane, int], None]  # key bytes, key, pane, output event time


class WindowClosedError(Exception):
    """Every window of a record has closed: it goes to dead letters with this reason."""


def closed_reason(ts: int, windows: Sequence[Span], watermark: int, lateness: int) -> str:
    """Why a record is not added to its windows."""
    last = max(end for _, end in windows)
    return (
        f"event time {ts} falls in windows that have closed (the latest ends at {last}, the "
        f"watermark is {watermark}, allowed lateness {lateness} ms): their final panes have "
        "been emitted; raise allowed_lateness to take records this late"
    )


class WindowedCombine:
    """A windowed combine node of one task (see the module docstring)."""

    def __init__(
        self,
        spec: OpSpec,
        stateful: bool,
        chunked: bool,
        watermark: int | None,
        now: int | None,
    ) -> None:
        assert spec.combine_fn is not None and spec.windowing is not None
        self.spec = spec
        self.fn: CombineFn = spec.combine_fn
        self.windowing: Windowing = spec.windowing
        self.stateful = stateful
        self.chunked = chunked
        self.merging = spec.phase is Phase.FINAL  # inputs are partials [start, end, acc, n]
        self.watermark = watermark  # None: bounded, nothing closes before the end
        self.now = now or 0
        self.per_record = stateful and self.windowing.trigger.late_mode is Late.RECORD
        # this chunk's deltas: key bytes -> [key, {span: [acc, records, newest]}]
        self.acc: dict[bytes, list[Any]] = {}
        # per-record late panes: key bytes -> [key, [(span, acc, records, ts), ...]]
        self.records: dict[bytes, list[Any]] = {}
        self.running: dict[bytes, list[Any]] = {}  # chunked partials: committed deltas
        self.touched: dict[bytes, Any] = {}  # keys changed by the batch
        self.pending: dict[bytes, Any] = {}
        self.closed_parts = 0  # memberships dropped because that window had closed
        self.failed: Callable[[Any, BaseException], None] = _reraise
        # Windows of a lifted partial that had closed, while others were open: a dead letter
        # of (reason, (key, those windows)).
        self.closed_windows: Callable[[str, Any], None] = _refuse

    # -- adding ------------------------------------------------------------------------

    def _open_windows(self, ts: int, spans: list[Span]) -> list[Span]:
        """The spans still open at the watermark; raises when none is."""
        wm = self.watermark
        if wm is None:
            return spans
        lateness = self.windowing.allowed_lateness_ms
        if min(end for _, end in spans) + lateness > wm:  # the common case: all open
            return spans
        open_ = [s for s in spans if not self.windowing.closed(s[1], wm)]
        if len(open_) < len(spans):
            if not open_:
                raise WindowClosedError(closed_reason(ts, spans, wm, lateness))
            self.closed_parts += len(spans) - len(open_)
        return open_

    def add(self, kb: bytes, key: Any, value: Any, ts: int) -> None:
        """Fold a value (or, after lifting, a partial ``[start, end, acc, n]``) in."""
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
            slot = self.acc[kb] = [key, {}]
        windows = slot[1]
        for span in spans:
            entry = windows.get(span)
            if entry is None:
                windows[span] = [fn.add(fn.create(), value), 1, ts]
                continue
            entry[0] = fn.add(fn.create(), value) if entry[0] is None else fn.add(entry[0], value)
            entry[1] += 1
            entry[2] = max(entry[2], ts)

    def _add_windows(self, kb: bytes, key: Any, windows: list[list[Any]]) -> None:
        """A lifted partial's windows; those that have closed go to dead letters."""
        wm = self.watermark
        closed = []
        for window in windows:
            start, end, acc, n, newest = window
            if wm is not None and self.windowing.closed(end, wm):
                closed.append(window)
            else:
                self._put(kb, key, (start, end), acc, n, newest)
        if closed:
            assert wm is not None
            newest = max(w[4] for w in closed)
            reason = closed_reason(
                newest, [(w[0], w[1]) for w in closed], wm, self.windowing.allowed_lateness_ms
            )
            if len(closed) == len(windows):
                raise WindowClosedError(reason)
            self.closed_windows(reason, (key, closed))

    def _entry(self, kb: bytes, key: Any, span: Span) -> list[Any]:
        slot = self.acc.get(kb)
        if slot is None:
            slot = self.acc[kb] = [key, {}]
        entry: list[Any] | None = slot[1].get(span)
        if entry is None:
            entry = slot[1][span] = [None, 0, NO_TIME]
        return entry

    def _put(self, kb: bytes, key: Any, span: Span, acc: Any, n: int, ts: int) -> None:
        if self.per_record:
            self._record(kb, key, span, acc, n, ts)
            return
        entry = self._entry(kb, key, span)
        entry[0] = acc if entry[0] is None else self.fn.merge(entry[0], acc)
        entry[1] += n
        entry[2] = max(entry[2], ts)

    def _record(self, kb: bytes, key: Any, span: Span, acc: Any, n: int, ts: int) -> None:
        slot = self.records.get(kb)
        if slot is None:
            slot = self.records[kb] = [key, []]
        slot[1].append((span, acc, n, ts))

    def touch(self, kb: bytes, key: Any, ts: int) -> None:  # noqa: ARG002 - CombineOp's API
        """A key whose records an earlier attempt of this task committed."""
        self.touched.setdefault(kb, key)

    # -- partial (lifted) ----------------------------------------------------------------

    def partials(self, source: dict[bytes, list[Any]]) -> list[tuple[bytes, Any, int, list[Any]]]:
        """``(key bytes, key, newest, [[start, end, acc, n, newest], ...])`` per key.

        Sessions are merged; ``newest`` is the newest event time over the key's windows.
        """
        out = []
        for kb, (key, spans) in source.items():
            items = list(spans.items())
            if self.windowing.fn.merging:
                items = self._merge_partials(items)
            windows = [[start, end, acc, n, t] for (start, end), (acc, n, t) in items]
            out.append((kb, key, max(w[4] for w in windows), windows))
        return out

    def _merge_partials(self, items: list[tuple[Span, list[Any]]]) -> list[tuple[Span, list[Any]]]:
        merged = []
        for span, members in merge_spans([s for s, _ in items]):
            acc, n, newest = None, 0, NO_TIME
            for i in members:
                a, k, t = items[i][1]
                acc = a if acc is None else self.fn.merge(acc, a)
                n += k
                newest = max(newest, t)
            merged.append((span, [acc, n, newest]))
        return merged

    def seed(self, kb: bytes, value: bytes, ts: int) -> None:
        """Merge a committed partial (this attempt's, or replayed from backup) into the sum."""
        decoded = codec.decode(value)
        if decoded and isinstance(decoded[0], list):
            windows = decoded
        else:  # one window, as backups written before hold it
            windows = [[*decoded, ts]]
        slot = self.running.get(kb)
        if slot is None:
            slot = self.running[kb] = [codec.decode(kb), {}]
        for start, end, acc, n, newest in windows:
            self._merge_into(slot[1], (start, end), acc, n, newest)

    def _merge_into(
        self, into: dict[Span, list[Any]], span: Span, acc: Any, n: int, t: int
    ) -> None:
        entry = into.get(span)
        if entry is None:
            into[span] = [acc, n, t]
        else:
            entry[0] = self.fn.merge(entry[0], acc)
            entry[1] += n
            entry[2] = max(entry[2], t)

    def deltas(self) -> list[tuple[bytes, int, bytes]]:
        """This chunk's partials, encoded, to back up with the chunk."""
        return [
            (kb, newest, codec.encode(partial))
            for kb, _key, newest, partial in self.partials(self.acc)
        ]

    def drain(self) -> list[tuple[bytes, Any, int, list[Any]]]:
        """Everything a partial accumulated, for the end-of-task flush."""
        if self.chunked:
            self._keep_chunk()
            out = self.partials(self.running)
            self.running = {}
        else:
            out = self.partials(self.acc)
        self.acc = {}
        return out

    # -- stateful (streaming) ----------------------------------------------------------

    def updates(self, reader: StateReader, emit: Emit) -> StateWrite:
        """New state for every key with records in this chunk (and per-record late panes)."""
        keys = list(dict.fromkeys([*self.acc, *self.records]))
        if not keys:
            return StateWrite()
        current = reader(self.spec.name, keys)
        write = StateWrite()
        for kb in keys:
            slot = self.acc.get(kb) or self.records[kb]
            key = slot[0]
            entries = decode_entries(current.get(kb))
            if kb in self.acc:
                deltas = self.acc[kb][1]
                if self.windowing.fn.merging:
                    for span, (acc, n, newest) in deltas.items():
                        entries = self._apply(entries, span, acc, n, newest)
                else:
                    self._apply_all(entries, deltas)
            if kb in self.records:
                for span, acc, n, ts in self.records[kb][1]:
                    entries = self._apply(entries, span, acc, n, ts)
                    self._late_panes(kb, key, entries, emit)
            self._write(write, kb, entries)
            self.pending[kb] = key
        return write

    def _apply_all(self, entries: list[list[Any]], deltas: Mapping[Span, list[Any]]) -> None:
        """Add a chunk's deltas to windows that never merge (one lookup per window)."""
        by_span = {(e[START], e[END]): e for e in entries}
        merge = self.fn.merge
        now = self.now
        for span, (acc, n, newest) in deltas.items():
            entry = by_span.get(span)
            if entry is None:
                entry = by_span[span] = [span[0], span[1], acc, n, 0, False, now, newest]
                entries.append(entry)
                continue
            entry[ACC] = acc if entry[ACC] is None else merge(entry[ACC], acc)
            if entry[SINCE] == 0:
                entry[FIRST] = now
            entry[SINCE] += n
            entry[NEWEST] = max(entry[NEWEST], newest)

    def _apply(
        self, entries: list[list[Any]], span: Span, acc: Any, n: int, newest: int
    ) -> list[list[Any]]:
        """Add a delta to its window (a new one if needed; sessions merge)."""
        entry = next((e for e in entries if e[START] == span[0] and e[END] == span[1]), None)
        if entry is None:
            entry = [span[0], span[1], None, 0, 0, False, 0, NO_TIME]
            entries.append(entry)
        entry[ACC] = acc if entry[ACC] is None else self.fn.merge(entry[ACC], acc)
        if entry[SINCE] == 0:
            entry[FIRST] = self.now
        entry[SINCE] += n
        entry[NEWEST] = max(entry[NEWEST], newest)
        if self.windowing.fn.merging:
            return self._merge_sessions(entries)
        return entries

    def _merge_sessions(self, entries: list[list[Any]]) -> list[list[Any]]:
        """Merge overlapping sessions into one window each.

        The merged window takes in the parts' accumulators and records not yet in a pane. It
        is a new window (its panes count from 0, its end has not been passed), unless it has
        the bounds of one of its parts (a session that took in smaller ones): then it goes
        on as that window.
        """
        groups = merge_spans([(e[START], e[END]) for e in entries])
        if len(groups) == len(entries):
            return entries
        out = []
        for (start, end), members in groups:
            if len(members) == 1:
                out.append(entries[members[0]])
                continue
            parts = [entries[i] for i in members]
            acc = None
            for p in parts:
                if p[ACC] is not None:
                    acc = p[ACC] if acc is None else self.fn.merge(acc, p[ACC])
            firsts = [p[FIRST] for p in parts if p[SINCE] > 0]
            same = next((p for p in parts if p[START] == start and p[END] == end), None)
            out.append(
                [
                    start,
                    end,
                    acc,
                    sum(p[SINCE] for p in parts),
                    same[INDEX] if same is not None else 0,
                    same[PASSED] if same is not None else False,
                    min(firsts) if firsts else 0,
                    max(p[NEWEST] for p in parts),
                ]
            )
        return out

    def _late_panes(self, kb: bytes, key: Any, entries: list[list[Any]], emit: Emit) -> None:
        """``late="record"``: a pane for each window past its end that took a record."""
        for entry in entries:
            if entry[PASSED] and entry[SINCE] > 0:
                self._fire(kb, key, entry, Timing.LATE, final=False, emit=emit)

    def chunk_committed(self) -> None:
        """The chunk is durable: its keys count as touched."""
        for kb, key in self.pending.items():
            self.touched.setdefault(kb, key)
        self.pending.clear()
        if self.chunked:
            self._keep_chunk()
        self.acc.clear()
        self.records.clear()

    def _keep_chunk(self) -> None:
        """A partial's committed chunk joins its running sums (sessions merge at the end)."""
        for kb, (key, spans) in self.acc.items():
            slot = self.running.get(kb)
            if slot is None:
                slot = self.running[kb] = [key, {}]
            for span, (acc, n, t) in spans.items():
                self._merge_into(slot[1], span, acc, n, t)
        self.acc = {}

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
        for kb in sorted(keys):
            raw = current.get(kb)
            if raw is None:
                continue
            key = self.touched.get(kb)
            if key is None:
                key = codec.decode(kb)
            entries = [e for e in decode_entries(raw) if not self._settle(kb, key, e, emit)]
            self._write(write, kb, entries)
        self.touched.clear()
        return write

    def _settle(self, kb: bytes, key: Any, entry: list[Any], emit: Emit) -> bool:
        """Fire what is due for one window; True when it closed (its state goes)."""
        wm = self.watermark if self.watermark is not None else NO_TIME
        trigger = self.windowing.trigger
        passed_now = entry[END] <= wm and not entry[PASSED]
        if self.windowing.closed(entry[END], wm):
            timing = Timing.ON_TIME if passed_now or not entry[PASSED] else Timing.LATE
            self._fire(kb, key, entry, timing, final=True, emit=emit)
            return True
        if passed_now:
            entry[PASSED] = True
            if trigger.on_time:
                self._fire(kb, key, entry, Timing.ON_TIME, final=False, emit=emit)
            else:  # records so far wait for the final pane; late panes are for late records
                entry[SINCE] = 0
                entry[FIRST] = 0
        elif entry[PASSED]:
            if entry[SINCE] > 0 and trigger.late_mode is Late.BATCH:
                self._fire(kb, key, entry, Timing.LATE, final=False, emit=emit)
        elif entry[SINCE] > 0 and self._early_due(entry):
            self._fire(kb, key, entry, Timing.EARLY, final=False, emit=emit)
        return False

    def _early_due(self, entry: list[Any]) -> bool:
        trigger = self.windowing.trigger
        if trigger.early_every is not None and entry[SINCE] >= trigger.early_every:
            return True
        early_ms = trigger.early_ms
        return early_ms is not None and self.now - entry[FIRST] >= early_ms

    def _fire(
        self, kb: bytes, key: Any, entry: list[Any], timing: Timing, final: bool, emit: Emit
    ) -> None:
        fn = self.fn
        try:
            value = fn.extract(entry[ACC] if entry[ACC] is not None else fn.create())
        except Exception as exc:  # noqa: BLE001 - user code: the pane becomes a dead letter
            self.failed(key, exc)
        else:
            pane = Pane(value, entry[START], entry[END], timing.value, entry[INDEX], final)
            emit(kb, key, pane, entry[END] - 1 if entry[END] < GLOBAL_END else entry[NEWEST])
        entry[INDEX] += 1
        entry[SINCE] = 0
        entry[FIRST] = 0
        if self.windowing.discarding:
            entry[ACC] = None

    def _write(self, write: StateWrite, kb: bytes, entries: list[list[Any]]) -> None:
        """The key's new state and timers into ``write``."""
        write.values[kb] = encode_entries(entries)
        event, processing = self._timers(entries)
        write.timers.setdefault(EVENT_TIMERS, {})[kb] = event
        write.timers.setdefault(PROCESSING_TIMERS, {})[kb] = processing

    def _timers(self, entries: list[list[Any]]) -> tuple[int | None, int | None]:
        """When the key next needs looking at: by the watermark, and by the clock."""
        lateness = self.windowing.allowed_lateness_ms
        early_ms = self.windowing.trigger.early_ms
        event: int | None = None
        processing: int | None = None
        for e in entries:
            if e[END] < GLOBAL_END:
                at = e[END] if not e[PASSED] else e[END] + lateness
                event = at if event is None else min(event, at)
            if early_ms is not None and e[SINCE] > 0 and not e[PASSED]:
                at = e[FIRST] + early_ms
                processing = at if processing is None else min(processing, at)
        return event, processing

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


def decode_entries(raw: bytes | None) -> list[list[Any]]:
    """A key's window entries from its stored state."""
    if raw is None:
        return []
    return [list(e) for e in codec.decode(raw)]


def encode_entries(entries: list[list[Any]]) -> bytes | None:
    """A key's stored state, or None (delete it) when no window is left."""
    if not entries:
        return None
    return codec.encode(sorted(entries, key=lambda e: (e[START], e[END])))
