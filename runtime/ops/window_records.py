"""Window state as named records, and their stored (wire) forms.

Three forms, each with a wire layout that is a data format (Redis state, backups, the
shuffle): keep them, convert only here.

* :class:`WindowState`, a window of a key's stored state, stored as
  ``[start, end, accumulator, records since the last pane, panes fired, end passed,
  batch time of the pane's first record, newest event time]``; the accumulator is ``None``
  after a discarding pane.
* :class:`Delta`, what a chunk (or a lifted partial) added to one window: accumulator,
  records, newest event time. A lifted partial crosses the shuffle and sits in backups as
  ``[[start, end, accumulator, records, newest], ...]`` (:class:`PartialWindow`).
* :class:`LateRecord`, one record's contribution to a window that fires a pane per record.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from onceflow.kernel import codec
from onceflow.kernel.windows import Span, merge_spans

NO_TIME = -(1 << 62)

Merge = Callable[[Any, Any], Any]
Partial = tuple[bytes, Any, int, list[list[Any]]]  # key bytes, key, newest, wire windows


@dataclass(slots=True)
class WindowState:
    """One open window of a key, as stored (see the module docstring for its wire form)."""

    start: int
    end: int
    acc: Any
    since: int  # records since the last pane
    index: int  # panes fired
    passed: bool  # the watermark passed its end
    first: int  # batch time of the pane's first record
    newest: int  # newest event time

    @property
    def span(self) -> Span:
        """``(start, end)``."""
        return (self.start, self.end)

    def wire(self) -> list[Any]:
        """The stored form: a list in field order."""
        return [
            self.start,
            self.end,
            self.acc,
            self.since,
            self.index,
            self.passed,
            self.first,
            self.newest,
        ]


@dataclass(slots=True)
class Delta:
    """What a chunk added to one window: accumulator, records, newest event time."""

    acc: Any
    records: int
    newest: int

    def merge(self, acc: Any, records: int, newest: int, merge: Merge) -> None:
        """Fold another delta of the same window in (``merge``: the CombineFn's)."""
        self.acc = acc if self.acc is None else merge(self.acc, acc)
        self.records += records
        self.newest = max(self.newest, newest)


class PartialWindow(NamedTuple):
    """One window of a lifted partial, as it crosses the shuffle and sits in backups."""

    start: int
    end: int
    acc: Any
    records: int
    newest: int


class LateRecord(NamedTuple):
    """One record's part of a window that fires a pane per late record."""

    span: Span
    acc: Any
    records: int
    ts: int


@dataclass(slots=True)
class KeyDeltas:
    """A key's deltas, by window."""

    key: Any
    windows: dict[Span, Delta] = field(default_factory=dict)


@dataclass(slots=True)
class KeyLate:
    """A key's late records, each firing a pane of its own."""

    key: Any
    late: list[LateRecord] = field(default_factory=list)


def decode_entries(raw: bytes | None) -> list[WindowState]:
    """A key's windows from its stored state."""
    if raw is None:
        return []
    return [WindowState(*e) for e in codec.decode(raw)]


def encode_entries(entries: list[WindowState]) -> bytes | None:
    """A key's stored state, or None (delete it) when no window is left."""
    if not entries:
        return None
    return codec.encode([e.wire() for e in sorted(entries, key=lambda e: (e.start, e.end))])


def partial_windows(value: Any, ts: int) -> list[PartialWindow]:
    """A committed partial's windows; the one-window form older backups hold included."""
    if value and isinstance(value[0], list):
        return [PartialWindow(*w) for w in value]
    start, end, acc, n = value  # one window, as backups written before hold it
    return [PartialWindow(start, end, acc, n, ts)]


def to_wire(items: Iterable[tuple[Span, Delta]]) -> list[list[Any]]:
    """A lifted partial's windows in their wire form."""
    return [[start, end, d.acc, d.records, d.newest] for (start, end), d in items]


def merge_into(into: dict[Span, Delta], span: Span, delta: Delta, merge: Merge) -> None:
    """Add a copy of ``delta`` to ``into[span]`` (``merge``: the CombineFn's)."""
    entry = into.get(span)
    if entry is None:
        into[span] = Delta(delta.acc, delta.records, delta.newest)
    else:
        entry.acc = merge(entry.acc, delta.acc)
        entry.records += delta.records
        entry.newest = max(entry.newest, delta.newest)


def merge_partials(items: list[tuple[Span, Delta]], merge: Merge) -> list[tuple[Span, Delta]]:
    """Deltas of overlapping sessions merged into one per merged session."""
    merged = []
    for span, members in merge_spans([s for s, _ in items]):
        acc, n, newest = None, 0, NO_TIME
        for i in members:
            d = items[i][1]
            acc = d.acc if acc is None else merge(acc, d.acc)
            n += d.records
            newest = max(newest, d.newest)
        merged.append((span, Delta(acc, n, newest)))
    return merged


def key_partials(source: dict[bytes, KeyDeltas], sessions: bool, merge: Merge) -> list[Partial]:
    """``(key bytes, key, newest, [[start, end, acc, n, newest], ...])`` per key.

    With ``sessions``, overlapping windows are merged; ``newest`` is the newest event time
    over the key's windows.
    """
    out = []
    for kb, slot in source.items():
        items = list(slot.windows.items())
        if sessions:
            items = merge_partials(items, merge)
        newest = max(d.newest for _, d in items)
        out.append((kb, slot.key, newest, to_wire(items)))
    return out
