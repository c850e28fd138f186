"""A process stage on the executor: per-key user state and timers (``Stream.process``).

When each step runs, and why it is exactly-once:

* Records of a chunk are buffered per key (:meth:`ProcessOp.add`). When the chunk is about
  to commit (:meth:`ProcessOp.updates`), the state of its keys is read (one HMGET), the
  user's function runs on each record in arrival order with the key's state in memory, and
  the new state of every key goes into the chunk's :class:`StateWrite`: it is committed in
  the same atomic step as the chunk's seen-marks and outputs (the combine path's commit),
  and the outputs are backed up with it. A retry of a committed chunk replays its outputs
  from the backup and never runs the function again, so non-deterministic code gives one
  result; a refused commit (conflict, too large) forgets the chunk and runs it again.
* Timers live in the key's state; the key's earliest event-time and processing-time timers
  are also scores in the node's timer sets (the windows' sets), so that the end of a task
  finds the keys with a timer due (:meth:`ProcessOp.fire`): event-time ones at or before the
  micro-batch's watermark, processing-time ones at or before its time. ``on_timer`` runs for
  each, earliest first, and the firings' outputs and state changes are committed with the
  task's end-of-task step (``FINISH``), so a timer fires once: a crash before that step fires
  it again with the same IDs (``batch, key, firing number``), after it never. A firing's
  outputs carry the timer's time (event time), or the event time of the element that set it
  (processing time) moved up to the watermark the batch started from if that has passed it,
  so that windows downstream take them (:func:`firing_time`).
* With a time-to-live, the stored form carries an expiry (``now + ttl`` at every write,
  batch time) and the ``expiry`` timer set lets ``onceflow gc`` delete it; state read after
  its expiry counts as empty (its timers are gone with it).

A record (or a firing) whose function raises becomes a dead letter and leaves the key's
state as it was before it. Stored form of a key: ``[{spec name: value}, [[tag, domain, time,
hold], ...], expiry or None]`` as MessagePack (maps as ``[[key, value], ...]``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from onceflow.kernel import codec
from onceflow.kernel.eventtime import as_event_time
from onceflow.kernel.ids import Deriver
from onceflow.kernel.records import Guarantee, StateWrite
from onceflow.runtime.ops.combine import EXPIRY_TIMERS
from onceflow.runtime.ops.key_state import KeyState
from onceflow.runtime.ops.record_text import Cursor
from onceflow.runtime.ops.window_panes import EVENT_TIMERS, PROCESSING_TIMERS
from onceflow.runtime.spec import OpSpec
from onceflow.runtime.user_state import (
    EVENT_TIME,
    PROCESSING_TIME,
    Context,
    ProcessSpec,
    Timer,
    Timers,
    TimestampedValue,
)

StateReader = Callable[[str, Sequence[bytes]], Mapping[bytes, bytes | None]]
TimerReader = Callable[[str, int, int], Sequence[bytes]]
Push = Callable[[Any], None]
Fail = Callable[[str, BaseException, Any], None]
Step = Callable[[], AbstractContextManager[None]]  # what an op emits in it runs on at its end

NO_TIME = -(1 << 62)  # the watermark of a bounded run while its input is read
END_OF_TIME = 1 << 62  # a bounded run's watermark and time once its input has ended
# A key's timers fired in one task at most: a timer function that keeps setting due timers
# fires on in the next micro-batch (a bounded run fails the key instead of looping).
MAX_FIRINGS = 1000


def _outputs(result: Any) -> list[Any]:
    """A function's outputs: what it returned or yielded (None: nothing)."""
    if result is None:
        return []
    if isinstance(result, list):
        return result
    if isinstance(result, str | bytes | dict):
        msg = (
            f"a process function returns or yields its outputs, got a {type(result).__name__}; "
            "return [value] (or yield value) to emit one"
        )
        raise TypeError(msg)
    return list(result)


def _stamped(results: list[Any], ts: int) -> list[tuple[int | None, Any]]:
    """Each output with its own event time (None: the call's), checked before any leaves."""
    stamped: list[tuple[int | None, Any]] = []
    for r in results:
        if not isinstance(r, TimestampedValue):
            stamped.append((None, r))
            continue
        at = as_event_time(r.timestamp)
        if at < ts:
            msg = (
                f"an output's timestamp {at} is earlier than ctx.timestamp {ts}: an output "
                "may only move forward in event time"
            )
            raise ValueError(msg)
        stamped.append((at, r.value))
    return stamped


class ProcessOp:
    """A process node of one task (see the module docstring)."""

    def __init__(
        self,
        spec: OpSpec,
        stateful: bool,
        where: tuple[int, int | None, int | None],
        cursor: Cursor,
        fail: Fail,
    ) -> None:
        assert spec.process is not None
        self.spec = spec
        self.process: ProcessSpec = spec.process
        self.specs = {s.name: s for s in self.process.states}
        self.stateful = stateful  # False: a bounded run keeps state in the task
        self.batch, watermark, now = where
        self.watermark = watermark if watermark is not None else NO_TIME
        # What elements see as the watermark: the batch before's (a record behind it is
        # late), as windows do; this batch's watermark advances at its end, where timers fire.
        self.element_watermark = self.watermark
        self.now = now or 0
        self.ttl_ms = self.process.ttl_ms if stateful else None
        self.cursor = cursor
        self.fail = fail
        self.deriver: Deriver | None = None  # set when IDs are on: firings' parent IDs
        self.out: Push = _nowhere  # set by the stage body: where outputs go
        self.buffer: dict[bytes, tuple[Any, list[tuple[Any, int, bytes]]]] = {}
        self.memory: dict[bytes, bytes] = {}  # bounded runs: the keys' state
        self.staged: dict[bytes, bytes | None] = {}  # bounded runs: the chunk's new state

    @classmethod
    def build(
        cls,
        spec: OpSpec,
        where: tuple[int, int | None, int | None, Guarantee],
        cursor: Cursor,
        fail: Fail,
        out: Push,
        previous_watermark: int | None = None,
    ) -> ProcessOp:
        """The op of one task: ``where`` is its batch, watermark, batch time and guarantee.

        ``previous_watermark``: the batch before's (see :class:`~onceflow.dedup.batch.BatchParams`);
        None: elements see the batch's own.
        """
        batch, watermark, now, mode = where
        op = cls(spec, mode.streaming, (batch, watermark, now), cursor, fail)
        if previous_watermark is not None:
            op.element_watermark = previous_watermark
        op.out = out
        if mode.ids:
            op.deriver = Deriver(spec.name)
        return op

    # -- records -------------------------------------------------------------------------

    def add(self, kb: bytes, key: Any, value: Any, ts: int) -> None:
        """Buffer one record of the chunk (it runs when the chunk commits)."""
        entry = self.buffer.get(kb)
        if entry is None:
            entry = self.buffer[kb] = (key, [])
        entry[1].append((value, ts, self.cursor.parent))

    def updates(self, reader: StateReader) -> StateWrite:
        """Run the chunk's records with their keys' state; the keys' new state."""
        write = StateWrite()
        if not self.buffer:
            return write
        current = self._read(reader, list(self.buffer))
        cursor = self.cursor
        for kb, (key, records) in self.buffer.items():
            state = KeyState.decode(current.get(kb), self.specs, self.now)
            if len(records) == 1 or not self._run_all(state, key, records):
                for value, ts, parent in records:
                    cursor.parent = parent
                    cursor.ts = ts
                    self._call(state, ts, (key, value), self.process.fn, (key, value), element=True)
            self._store(write, kb, state)
        return write

    def _run_all(self, state: KeyState, key: Any, records: list[tuple[Any, int, Any]]) -> bool:
        """Run a key's records of the chunk in one go, encoding its state once at the end.

        Undoing a failing call needs the state as it was before that call: encoding it after
        every call costs the whole state per record (quadratic for a key that buffers, as a
        join's waiting records). So the key's records run first without it, their outputs
        held back; only if every call succeeds and the state then encodes do the outputs
        leave (in order, each with its record's cursor). Otherwise the key's state goes back
        to what it was before the chunk, the held outputs are forgotten, and the caller runs
        the records one at a time, a failing one becoming a dead letter.
        """
        fn, on = self.process.fn, self.process.on_timer is not None
        held: list[tuple[Any, int, list[tuple[int | None, Any]]]] = []
        try:
            for value, ts, parent in records:
                ctx = Context(
                    self.specs,
                    state.cells,
                    Timers(state.timers, ts, on),
                    (ts, self.element_watermark, self.now),
                )
                held.append((parent, ts, _stamped(_outputs(fn(key, value, ctx)), ts)))
            state.saved = state.snapshot(self.specs)
        except Exception:  # noqa: BLE001 - user code: run one at a time to find it
            state.restore(self.specs)
            return False
        cursor = self.cursor
        for parent, ts, results in held:
            cursor.parent = parent
            cursor.ts = ts
            self._emit(results, ts)
        return True

    def _call(
        self,
        state: KeyState,
        ts: int,
        what: Any,
        fn: Callable[..., Any],
        args: tuple[Any, Any],
        node: str = "",
        element: bool = False,
    ) -> None:
        """Run ``fn(*args, ctx)``; on an exception undo its state changes, dead-letter it.

        The state must encode after the call (that is checked here, not at the commit, so a
        value that cannot be stored fails its own record only). ``node`` names the dead
        letter's node (default: the op; a timer's letter names ``<op>/on_timer``, so that
        replaying it is refused rather than run as an element).
        """
        ctx = Context(
            self.specs,
            state.cells,
            Timers(state.timers, ts, self.process.on_timer is not None),
            (ts, self.element_watermark if element else self.watermark, self.now),
        )
        try:
            results = _stamped(_outputs(fn(*args, ctx)), ts)
            state.saved = state.snapshot(self.specs)
        except Exception as exc:  # noqa: BLE001 - user code: a dead letter
            state.restore(self.specs)
            self.fail(node or self.spec.name, exc, what)
            return
        self._emit(results, ts)

    def _emit(self, results: list[tuple[int | None, Any]], ts: int) -> None:
        """Pass a call's outputs on (``ts``: the call's time, which the cursor holds)."""
        out, cursor = self.out, self.cursor
        for stamp, r in results:
            if stamp is None:
                out(r)
                continue
            cursor.ts = stamp
            try:
                out(r)
            finally:
                cursor.ts = ts

    def _read(self, reader: StateReader, keys: list[bytes]) -> Mapping[bytes, bytes | None]:
        if self.stateful:
            return reader(self.spec.name, keys)
        return {kb: self.staged.get(kb, self.memory.get(kb)) for kb in keys}

    def _store(self, write: StateWrite, kb: bytes, state: KeyState, force: bool = False) -> None:
        """The key's new state and timer scores into ``write`` (bounded: into memory).

        What did not change is not written (``force``: the timer scores are, because the
        timer sets named the key as due: a score left behind would name it again).
        """
        expiry = self.now + self.ttl_ms if self.ttl_ms is not None else None
        raw = state.encode(self.specs, expiry)
        if not self.stateful:
            self.staged[kb] = raw
            return
        if raw == state.origin and not force:
            return
        write.values[kb] = raw
        event = state.earliest(EVENT_TIME) if raw is not None else None
        processing = state.earliest(PROCESSING_TIME) if raw is not None else None
        old_event, old_processing = state.scores
        if force or event != old_event:
            write.timers.setdefault(EVENT_TIMERS, {})[kb] = event
        if force or processing != old_processing:
            write.timers.setdefault(PROCESSING_TIMERS, {})[kb] = processing
        if self.ttl_ms is not None:
            write.timers.setdefault(EXPIRY_TIMERS, {})[kb] = expiry if raw is not None else None

    def chunk_committed(self) -> None:
        """The chunk is durable (bounded: its state becomes the task's)."""
        self.buffer.clear()
        for kb, raw in self.staged.items():
            if raw is None:
                self.memory.pop(kb, None)
            else:
                self.memory[kb] = raw
        self.staged.clear()

    def reset_chunk(self) -> None:
        """Forget the chunk (its commit was refused; it will be redone)."""
        self.buffer.clear()
        self.staged.clear()

    # -- timers --------------------------------------------------------------------------

    def fire(self, reader: StateReader, timers: TimerReader | None) -> StateWrite:
        """End of task: run ``on_timer`` for every timer due; the keys' new state."""
        write = StateWrite()
        if self.process.on_timer is None:
            return write
        if self.stateful:
            assert timers is not None
            wm, now = self.watermark, self.now
            keys = sorted(set(timers(self.spec.name, wm, now)))
        else:  # the input has ended: every timer is due (the functions see it so)
            wm = now = self.watermark = self.now = END_OF_TIME
            keys = sorted(self.memory)
        if not keys:
            return write
        current = self._read(reader, keys)
        for kb in keys:
            state = KeyState.decode(current.get(kb), self.specs, self.now)
            self._fire_key(kb, state, wm, now)
            self._store(write, kb, state, force=True)
        self.chunk_committed()
        return write

    def _fire_key(self, kb: bytes, state: KeyState, wm: int, now: int) -> None:
        """Fire the key's due timers, earliest first (those its firings set too)."""
        on_timer = self.process.on_timer
        assert on_timer is not None
        key = codec.decode(kb)
        for n in range(MAX_FIRINGS + 1):
            timer = state.due(wm, now)
            if timer is None:
                return
            if n == MAX_FIRINGS and not self.stateful:
                msg = f"on_timer kept setting due timers: {MAX_FIRINGS} fired for one key"
                self.fail(self.spec.name, RuntimeError(msg), key)
                return
            if n == MAX_FIRINGS:
                return  # the rest fire in the next micro-batch
            del state.timers[timer.tag]
            state.saved = state.snapshot(self.specs)  # a failing on_timer still consumes it
            if self.deriver is not None:
                self.cursor.parent = self.deriver.of(self.batch, kb, n)
            ts = firing_time(timer, self.element_watermark)
            self.cursor.ts = ts
            node = f"{self.spec.name}/on_timer"
            self._call(state, ts, (key, list(timer)), on_timer, (key, timer), node)


def firing_time(timer: Timer, element_watermark: int) -> int:
    """The event time of a firing: ``ctx.timestamp`` in ``on_timer`` and its outputs'.

    An event-time timer's is its time: at or behind the watermark that fired it, and a window
    downstream still takes its outputs (it closes at the end of this batch). A processing-time
    timer's is the event time of the element that set it (its hold), unless the watermark has
    passed that since: then ``element_watermark``, the one the micro-batch started from, the
    earliest event time no window downstream has closed on. The watermark is not held at
    pending processing-time timers (as Beam holds it): a wall-clock timer set an hour ahead
    would hold every window and event-time timer downstream for that hour. (A bounded run
    closes nothing before its end: its element watermark is the beginning of time.)
    """
    if timer.domain == EVENT_TIME:
        return timer.time
    return max(timer.hold, element_watermark)


def _nowhere(elem: Any) -> None:  # noqa: ARG001 - the default outlet
    msg = "a process op's outlet was not wired; this is a runtime bug"
    raise AssertionError(msg)


class Processes(dict[str, ProcessOp]):
    """A stage's process ops by name, stepped together by the stage body."""

    def updates(self, reader: StateReader, out: dict[str, StateWrite], step: Step) -> None:
        """Run the chunk's records; their new state into ``out`` (see :meth:`ProcessOp.updates`).

        Each op runs in a ``step`` of its own, at whose end what it emitted runs on.
        """
        for name, proc in self.items():
            with step():
                write = proc.updates(reader)
            if write:
                out[name] = write

    def chunk_committed(self) -> None:
        """The chunk is durable."""
        for proc in self.values():
            proc.chunk_committed()

    def reset_chunk(self) -> None:
        """The chunk will be redone."""
        for proc in self.values():
            proc.reset_chunk()

    def fire(
        self,
        reader: StateReader | None,
        timers: TimerReader | None,
        out: dict[str, StateWrite],
        step: Step,
    ) -> None:
        """End of task: fire the timers due; the keys' new state into ``out`` (a step each)."""
        for name, proc in self.items():
            with step():
                write = proc.fire(reader or _no_state, timers)
            if write:
                out[name] = write


def _no_state(node: str, keys: Sequence[bytes]) -> Mapping[bytes, bytes | None]:  # noqa: ARG001
    """A bounded run's reader: no state outside the task."""
    return {}
