"""A key's stored windows: adding deltas (sessions merge), firing panes, timers.

Every decision uses the micro-batch's watermark and batch time (``now``), fixed by its first
attempt, so a retried task fires the same panes with the same IDs (``key, window, pane
index``). See :mod:`~.windowed_combine` for when each step runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from onceflow.kernel.records import StateWrite
from onceflow.kernel.windows import GLOBAL_END, Late, Pane, Span, Timing, Windowing, merge_spans
from onceflow.runtime.combine_fn import CombineFn
from onceflow.runtime.ops.window_records import NO_TIME, Delta, WindowState, encode_entries

# Timer kinds (one sorted set each per combine node and partition).
EVENT_TIMERS = "event"
PROCESSING_TIMERS = "processing"

Emit = Callable[[bytes, Any, Pane, int], None]  # key bytes, key, pane, output event time
Failed = Callable[[Any, BaseException], None]


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


class WindowPanes:
    """The stateful side of a windowed combine: one key's windows at a time."""

    def __init__(
        self,
        fn: CombineFn,
        windowing: Windowing,
        watermarks: tuple[int | None, int | None],
        now: int,
        failed: Failed,
    ) -> None:
        self.fn = fn
        self.windowing = windowing
        # None: bounded, nothing closes before the end
        self.watermark, previous = watermarks  # the batch's: what fires at its end
        # the batch before's: windows it closed are closed (see BatchParams); none: the batch's
        self.closed_at = previous if previous is not None else self.watermark
        self.now = now
        self.failed = failed  # a pane whose extract raised: the user's function failed

    # -- adding --------------------------------------------------------------------------

    def open_windows(self, ts: int, spans: list[Span]) -> tuple[list[Span], int]:
        """The spans still open, and how many closed; raises if all did.

        A window that ends between the batch before's watermark and this batch's is open: it
        fires at the end of this batch, with these records. Records of event-time firings
        upstream (a pane at its window's last millisecond, a timer's output) always land
        there, and so do records of this batch behind its watermark whose window has not
        fired yet.
        """
        wm = self.closed_at
        if wm is None:
            return spans, 0
        lateness = self.windowing.allowed_lateness_ms
        if min(end for _, end in spans) + lateness > wm:  # the common case: all open
            return spans, 0
        open_ = [s for s in spans if not self.windowing.closed(s[1], wm)]
        if not open_:
            raise WindowClosedError(closed_reason(ts, spans, wm, lateness))
        return open_, len(spans) - len(open_)

    def apply_all(self, entries: list[WindowState], deltas: Mapping[Span, Delta]) -> None:
        """Add a chunk's deltas to windows that never merge (one lookup per window)."""
        by_span = {e.span: e for e in entries}
        merge = self.fn.merge
        now = self.now
        for span, d in deltas.items():
            entry = by_span.get(span)
            if entry is None:
                entry = WindowState(span[0], span[1], d.acc, d.records, 0, False, now, d.newest)
                by_span[span] = entry
                entries.append(entry)
                continue
            entry.acc = d.acc if entry.acc is None else merge(entry.acc, d.acc)
            if entry.since == 0:
                entry.first = now
            entry.since += d.records
            entry.newest = max(entry.newest, d.newest)

    def apply(
        self, entries: list[WindowState], span: Span, acc: Any, n: int, newest: int
    ) -> list[WindowState]:
        """Add a delta to its window (a new one if needed; sessions merge)."""
        entry = next((e for e in entries if e.start == span[0] and e.end == span[1]), None)
        if entry is None:
            entry = WindowState(span[0], span[1], None, 0, 0, False, 0, NO_TIME)
            entries.append(entry)
        entry.acc = acc if entry.acc is None else self.fn.merge(entry.acc, acc)
        if entry.since == 0:
            entry.first = self.now
        entry.since += n
        entry.newest = max(entry.newest, newest)
        if self.windowing.fn.merging:
            return self._merge_sessions(entries)
        return entries

    def _merge_sessions(self, entries: list[WindowState]) -> list[WindowState]:
        """Merge overlapping sessions into one window each.

        The merged window takes in the parts' accumulators and records not yet in a pane. It
        is a new window (its panes count from 0, its end has not been passed), unless it has
        the bounds of one of its parts (a session that took in smaller ones): then it goes
        on as that window.
        """
        groups = merge_spans([e.span for e in entries])
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
                if p.acc is not None:
                    acc = p.acc if acc is None else self.fn.merge(acc, p.acc)
            firsts = [p.first for p in parts if p.since > 0]
            same = next((p for p in parts if p.start == start and p.end == end), None)
            out.append(
                WindowState(
                    start,
                    end,
                    acc,
                    sum(p.since for p in parts),
                    same.index if same is not None else 0,
                    same.passed if same is not None else False,
                    min(firsts) if firsts else 0,
                    max(p.newest for p in parts),
                )
            )
        return out

    # -- firing --------------------------------------------------------------------------

    def late_panes(self, kb: bytes, key: Any, entries: list[WindowState], emit: Emit) -> None:
        """``late="record"``: a pane for each window past its end that took a record."""
        for entry in entries:
            if entry.passed and entry.since > 0:
                self._fire(kb, key, entry, Timing.LATE, final=False, emit=emit)

    def settle(self, kb: bytes, key: Any, entry: WindowState, emit: Emit) -> bool:
        """Fire what is due for one window; True when it closed (its state goes)."""
        wm = self.watermark if self.watermark is not None else NO_TIME
        trigger = self.windowing.trigger
        passed_now = entry.end <= wm and not entry.passed
        if self.windowing.closed(entry.end, wm):
            timing = Timing.ON_TIME if passed_now or not entry.passed else Timing.LATE
            self._fire(kb, key, entry, timing, final=True, emit=emit)
            return True
        if passed_now:
            entry.passed = True
            if trigger.on_time:
                self._fire(kb, key, entry, Timing.ON_TIME, final=False, emit=emit)
            else:  # records so far wait for the final pane; late panes are for late records
                entry.since = 0
                entry.first = 0
        elif entry.passed:
            if entry.since > 0 and trigger.late_mode is Late.BATCH:
                self._fire(kb, key, entry, Timing.LATE, final=False, emit=emit)
        elif entry.since > 0 and self._early_due(entry):
            self._fire(kb, key, entry, Timing.EARLY, final=False, emit=emit)
        return False

    def _early_due(self, entry: WindowState) -> bool:
        trigger = self.windowing.trigger
        if trigger.early_every is not None and entry.since >= trigger.early_every:
            return True
        early_ms = trigger.early_ms
        return early_ms is not None and self.now - entry.first >= early_ms

    def _fire(
        self, kb: bytes, key: Any, entry: WindowState, timing: Timing, final: bool, emit: Emit
    ) -> None:
        fn = self.fn
        try:
            value = fn.extract(entry.acc if entry.acc is not None else fn.create())
        except Exception as exc:  # noqa: BLE001 - user code: the pane becomes a dead letter
            self.failed(key, exc)
        else:
            pane = Pane(value, entry.start, entry.end, timing.value, entry.index, final)
            emit(kb, key, pane, entry.end - 1 if entry.end < GLOBAL_END else entry.newest)
        entry.index += 1
        entry.since = 0
        entry.first = 0
        if self.windowing.discarding:
            entry.acc = None

    # -- storing -------------------------------------------------------------------------

    def write(self, write: StateWrite, kb: bytes, entries: list[WindowState]) -> None:
        """The key's new state and timers into ``write``."""
        write.values[kb] = encode_entries(entries)
        event, processing = self._timers(entries)
        write.timers.setdefault(EVENT_TIMERS, {})[kb] = event
        write.timers.setdefault(PROCESSING_TIMERS, {})[kb] = processing

    def _timers(self, entries: list[WindowState]) -> tuple[int | None, int | None]:
        """When the key next needs looking at: by the watermark, and by the clock."""
        lateness = self.windowing.allowed_lateness_ms
        early_ms = self.windowing.trigger.early_ms
        event: int | None = None
        processing: int | None = None
        for e in entries:
            if e.end < GLOBAL_END:
                at = e.end if not e.passed else e.end + lateness
                event = at if event is None else min(event, at)
            if early_ms is not None and e.since > 0 and not e.passed:
                at = e.first + early_ms
                processing = at if processing is None else min(processing, at)
        return event, processing
