"""One key's state of a process stage in memory, and its stored form.

Stored form: ``[{spec name: value}, [[tag, domain, time, hold], ...], expiry or None]`` as
MessagePack (maps as ``[[key, value], ...]``); see :mod:`~.process`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from onceflow.kernel import codec
from onceflow.runtime.user_state import EVENT_TIME, Cells, StateSpec, Timer

EMPTY = codec.encode([{}, [], None])


class KeyState:
    """One key's state in memory: cells by spec name and timers by tag."""

    __slots__ = ("cells", "origin", "saved", "scores", "timers")

    def __init__(self, cells: Cells, timers: dict[str, Timer], saved: bytes) -> None:
        self.cells = cells
        self.timers = timers
        self.saved = saved  # the state after the last call that succeeded (encoded)
        self.origin: bytes | None = None  # as read: unchanged state is not written again
        self.scores: tuple[int | None, int | None] = (None, None)  # timer scores as read

    def snapshot(self, specs: Mapping[str, StateSpec[Any]]) -> bytes:
        """Cells and timers in the stored form, without expiry.

        Raises when a value cannot be encoded. After the last call it is the key's new state
        (it is not encoded again).
        """
        wire = {name: specs[name].wire(v) for name, v in self.cells.items()}
        return codec.encode([wire, [list(t) for t in sorted(self.timers.values())], None])

    def restore(self, specs: Mapping[str, StateSpec[Any]]) -> None:
        """Back to the last snapshot (a call failed)."""
        wire, timers, _ = codec.decode(self.saved)
        self.cells.clear()
        self.cells.update({name: specs[name].live(v) for name, v in wire.items()})
        self.timers.clear()
        self.timers.update({t[0]: Timer(*t) for t in timers})

    @classmethod
    def decode(cls, raw: bytes | None, specs: Mapping[str, StateSpec[Any]], now: int) -> KeyState:
        """A key's state from its stored form (empty when absent or expired at ``now``)."""
        if raw is None:
            return cls({}, {}, EMPTY)
        wire, timers, expiry = codec.decode(raw)
        if expiry is not None and expiry <= now:
            state = cls({}, {}, EMPTY)
        else:
            kept = {name: v for name, v in wire.items() if name in specs}  # dropped specs go
            cells = {name: specs[name].live(v) for name, v in kept.items()}
            same = expiry is None and len(kept) == len(wire)
            saved = raw if same else codec.encode([kept, timers, None])
            state = cls(cells, {t[0]: Timer(*t) for t in timers}, saved)
        state.origin = raw
        event = [t[2] for t in timers if t[1] == EVENT_TIME]
        processing = [t[2] for t in timers if t[1] != EVENT_TIME]
        state.scores = (min(event, default=None), min(processing, default=None))
        return state

    def encode(self, specs: Mapping[str, StateSpec[Any]], expiry: int | None) -> bytes | None:
        """The stored form, or None (delete the key) when nothing is left."""
        if not self.cells and not self.timers:
            return None
        if expiry is None:
            return self.saved  # the state after the last call (see :meth:`snapshot`)
        wire, timers, _ = codec.decode(self.saved)
        return codec.encode([wire, timers, expiry])

    def earliest(self, domain: str) -> int | None:
        """When the key's earliest timer of ``domain`` is due."""
        if not self.timers:
            return None
        return min((t.time for t in self.timers.values() if t.domain == domain), default=None)

    def due(self, watermark: int, now: int) -> Timer | None:
        """The earliest timer due at ``watermark`` (event time) or ``now`` (processing)."""
        due = [
            t
            for t in self.timers.values()
            if t.time <= (watermark if t.domain == EVENT_TIME else now)
        ]
        return min(due, key=lambda t: (t.time, t.domain, t.tag), default=None)
