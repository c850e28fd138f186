"""A stage's boundaries: what reaches a port, a sink or the dead-letter output, encoded.

Elements are buffered as columns, with their parents' IDs and timestamps; :meth:`Boundaries.take`
encodes them and, with IDs on, derives each output's ID from its parent, the boundary's name
and its index among that parent's outputs on that boundary. An output that cannot be encoded,
or is too large, becomes a dead letter of its input.

Dead letters made while a chunk runs through the stage (:mod:`~.flow`) are held with their
place in the stage's order (``pending``, keyed by ``keyer``) and join the dead-letter output
in that order when the chunk has run: ops run a chunk one after another, but letters keep the
order (and so the IDs) an element-at-a-time run gave them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from operator import add, itemgetter
from typing import Any

from onceflow.kernel import codec
from onceflow.kernel.errors import CodecError
from onceflow.kernel.ids import Deriver
from onceflow.kernel.records import DeadLetter, Output, Redrive, outputs_of
from onceflow.runtime.errors import RuntimeFailure
from onceflow.runtime.ops.batch import Key
from onceflow.runtime.ops.made import Made
from onceflow.runtime.ops.record_text import Cursor, StageFailure, describe, portable, too_large
from onceflow.runtime.spec import StageSpec, TargetKind, TargetSpec

_PAIR = frozenset((tuple,))
_FIRST, _SECOND = itemgetter(0), itemgetter(1)


class Boundaries:
    """The buffers of a stage's targets, and the dead letters counted (see the module doc)."""

    def __init__(
        self, spec: StageSpec, ids: bool, cursor: Cursor, origin: Callable[[bytes], str]
    ) -> None:
        self.spec = spec
        self.cursor = cursor
        self.origin = origin  # where a record (by its ID) comes from, for dead letters
        # per target: its elements, their parents' IDs and their timestamps
        self.buffers: list[Column] = [Column() for _ in spec.targets]
        self.derivers = [Deriver(t.name) if ids else None for t in spec.targets]
        self.dead_count = 0
        self.dead_codes: dict[str, int] = {}  # dead letters by reason (DeadLetter.code)
        self.pending: list[tuple[Key, DeadLetter]] | None = None  # letters of a running chunk
        self.keyer: Callable[[], Key] = _no_key  # the place of the letter made now
        self.stops: list[tuple[Key, RuntimeFailure, bytes]] = []  # failures that stop the task
        self.made = Made()  # the elements of sink outputs, until delivered

    def letter(
        self, node: str, reason: str, value: str, code: str, json_value: bool = False
    ) -> None:
        """A dead letter of the current record (``value``: its JSON or printable form)."""
        cursor = self.cursor
        origin = self.origin(cursor.parent)
        self.dead(
            DeadLetter(
                cursor.parent,
                cursor.ts,
                node,
                reason,
                origin,
                None,
                value,
                code,
                json_value=json_value,
            )
        )

    def unroutable(self, stage: str, replayed: Redrive) -> None:
        """A replayed dead letter naming a node this stage does not run: a letter again."""
        reason = (
            f"a replayed dead letter names node {replayed.node!r}, which stage {stage!r} does "
            "not run (the pipeline changed, or the letter came from a stage after a shuffle): "
            "send its value to the pipeline's input yourself"
        )
        self.letter(stage, reason, portable(replayed.value), "not_replayable")

    def add(
        self, target: int, elems: Sequence[Any], parents: Sequence[bytes], ts: Sequence[int]
    ) -> None:
        """Buffer elements for ``target`` (with their parents' IDs and timestamps)."""
        buf = self.buffers[target]
        buf.elems += elems
        buf.parents += parents
        buf.ts += ts

    def dead(self, letter: DeadLetter) -> None:
        """Send a dead letter to the stage's dead-letter output (held while a chunk runs)."""
        self.dead_count += 1
        self.dead_codes[letter.code] = self.dead_codes.get(letter.code, 0) + 1
        if self.pending is not None:
            self.pending.append((self.keyer(), letter))
            return
        self.add(self.spec.dead_target, [letter], [letter.id], [letter.ts])

    def stop(self, failure: RuntimeFailure) -> None:
        """Stop the task (``on_error="fail"``, or a StopStage) at the first failure in order.

        While a chunk runs, once it has run (:meth:`release_letters`).
        """
        if self.pending is None:
            raise failure
        self.stops.append((self.keyer(), failure, self.cursor.parent))

    def hold_letters(self) -> None:
        """A chunk starts to run: its letters wait for their place (see the module doc)."""
        assert self.pending is None, "a chunk runs while another runs; this is a runtime bug"
        self.pending = []

    def release_letters(self) -> None:
        """The chunk has run: its letters join the dead-letter output in the stage's order.

        With ``on_error="fail"`` the first failure in that order stops the task.
        """
        pending, self.pending = self.pending or [], None
        self.keyer = _no_key
        if self.stops:
            key, failure, parent = min(self.stops, key=_first)
            self.stops = []
            self.cursor.parent = parent
            raise failure from failure.__cause__
        pending.sort(key=_first)
        letters = [letter for _, letter in pending]
        if letters:
            self.add(
                self.spec.dead_target, letters, [x.id for x in letters], [x.ts for x in letters]
            )

    def take(self) -> list[Output]:
        """Encode everything buffered at the boundaries, deriving IDs when they are on."""
        outputs: list[Output] = []
        for target in self.spec.targets:  # the dead-letter target is last: it collects
            buf = self.buffers[target.index]  # encoding failures of the others
            if buf.elems:
                self.buffers[target.index] = Column()
                self._encode_target(target, buf, outputs)
        return outputs

    def _encode_target(self, target: TargetSpec, buf: Column, outputs: list[Output]) -> None:
        """A target's buffered elements as outputs: all at once, or one by one if one fails."""
        if target.kind is not TargetKind.DEAD:
            made = self._encode_all(target, buf)
            if made is not None:
                outputs += made
                if target.kind is TargetKind.SINK:
                    self.made.keep(made, buf.elems)
                return
        self._encode_each(target, buf, outputs)

    def _encode_all(self, target: TargetSpec, buf: Column) -> list[Output] | None:
        """Every element encoded and every ID derived in one loop each.

        None: one of them fails, or is too large, or is no pair on a keyed target; then they
        are encoded one by one.
        """
        elems = buf.elems
        n = len(elems)
        keys: Iterable[bytes | None]
        try:
            if target.keyed:
                if not (set(map(type, elems)) <= _PAIR and set(map(len, elems)) <= {2}):
                    return None
                keys = codec.encode_many(list(map(_FIRST, elems)))
                values = codec.encode_many(list(map(_SECOND, elems)))
                size = max(map(add, map(len, keys), map(len, values)))
            else:
                keys = repeat(None, n)
                values = codec.encode_many(elems)
                size = max(map(len, values))
        except CodecError:
            return None
        if size > self.spec.max_record_bytes:
            return None
        deriver = self.derivers[target.index]
        rids = deriver.children(buf.parents) if deriver is not None else repeat(b"", n)
        return outputs_of(repeat(target.index, n), rids, buf.ts, keys, values)

    def _encode_each(self, target: TargetSpec, buf: Column, outputs: list[Output]) -> None:
        """One element at a time: one that fails is a dead letter of its input."""
        deriver = self.derivers[target.index]
        dead = target.kind is TargetKind.DEAD
        keyed = target.keyed and not dead
        limit = self.spec.max_record_bytes
        index = target.index
        prev = None
        n = 0
        for parent, ts, elem in zip(buf.parents, buf.ts, buf.elems, strict=True):
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
            self.cursor.parent = parent  # the record the task's failure names
            raise StageFailure(reason)
        letter = DeadLetter(
            parent, ts, target.name, reason, self.origin(parent), None, describe(elem), "too_large"
        )
        self.dead(letter)

    def _boundary_dead(
        self, target: TargetSpec, parent: bytes, ts: int, elem: Any, exc: Exception, dead: bool
    ) -> None:
        if dead:  # a dead letter that cannot be encoded: keep its text only
            msg = f"cannot encode a dead letter of {target.name}: {exc}"
            raise RuntimeFailure(msg) from exc
        if self.spec.on_error == "fail":
            self.cursor.parent = parent  # the record the task's failure names
            msg = f"output of {target.name!r} cannot be written: {exc}"
            raise StageFailure(msg) from exc
        reason = f"cannot send to {target.name!r}: {exc}"
        if target.keyed and not (isinstance(elem, tuple) and len(elem) == 2):
            reason = f"{target.name!r} expects (key, value) pairs, got {describe(elem, 80)}"
        letter = DeadLetter(
            parent, ts, target.name, reason, self.origin(parent), None, describe(elem), "unwritable"
        )
        self.dead(letter)

    def clear(self) -> None:
        """Drop everything buffered (the chunk's commit was refused; it will be redone)."""
        self.buffers = [Column() for _ in self.spec.targets]
        self.made.reset_chunk()


class Column:
    """A target's buffered elements, with their parents' IDs and timestamps."""

    __slots__ = ("elems", "parents", "ts")

    def __init__(self) -> None:
        self.elems: list[Any] = []
        self.parents: list[bytes] = []
        self.ts: list[int] = []


def _no_key() -> Key:
    """No chunk is running: letters are not held (never called)."""
    return ()


def _first(item: tuple[Any, ...]) -> Any:
    return item[0]
