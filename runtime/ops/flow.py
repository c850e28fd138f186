"""A fused stage run a chunk at a time: each op applied once to a list of elements.

A chunk's rows enter at their inbound's entries; the ops then run in graph order (producers
first), each on the batch its producer made (:mod:`~.each` for element-wise ops; combines and
process ops fold theirs in a loop of their own), and what reaches a target is buffered
(:mod:`~.boundaries`). Where several producers feed one node, their batches are merged in the
order an element-at-a-time run would have fed it (:mod:`~.batch`); dead letters made on the
way are put in that order too when the chunk has run. So outputs, their order and their IDs,
and the dead letters, are what running each element through the stage, depth first, made.

Combines and process ops emit outside a chunk's run (their results when the task ends, panes,
a process function's outputs when the chunk commits): :meth:`Flow.outlet` collects what one of
them emits, and :meth:`Flow.emitting` runs it through the ops after it, in one go.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from itertools import compress
from typing import Any, cast

from onceflow.kernel import codec
from onceflow.kernel.errors import CodecError
from onceflow.kernel.records import InRow, Redrive
from onceflow.runtime.ops import each
from onceflow.runtime.ops.batch import Batch, Key, key_in, merged
from onceflow.runtime.ops.boundaries import Boundaries
from onceflow.runtime.ops.combine import CombineOp
from onceflow.runtime.ops.process import ProcessOp
from onceflow.runtime.ops.record_text import Cursor, ahead_reason, portable
from onceflow.runtime.ops.windowed_combine import WindowClosedError, WindowedCombine
from onceflow.runtime.spec import OpSpec, StageSpec

Folder = CombineOp | WindowedCombine | ProcessOp
Fail = Callable[[str, BaseException, Any], None]  # node, error, element
Consumers = list[tuple[int, bool]]  # (op position or target index, is an op), in push order
_PAIR = frozenset((tuple,))


class Flow:
    """The ops of one stage wired for batches (see the module docstring)."""

    def __init__(
        self,
        spec: StageSpec,
        out: Boundaries,
        cursor: Cursor,
        fail: Fail,
        limit: Callable[[], int | None],
    ) -> None:
        self.spec = spec
        self.out = out
        self.cursor = cursor
        self.fail = fail
        self.limit = limit  # the newest event time admitted (restamp)
        self.ops = spec.ops
        self.position = {op.name: n for n, op in enumerate(spec.ops)}
        self.consumers = [self._consumers(op.to_ops, op.to_targets) for op in spec.ops]
        self.entries = [self._consumers(i.entries, i.entry_targets) for i in spec.inbound]
        self.folders: dict[int, Folder] = {}  # combines and process ops, by position
        self.emitted: dict[int, Emitter] = {}
        self.slots = Slots()  # places of a step's emissions (see emitting)
        self.inbox: dict[int, list[tuple[Batch, int | None]]] = {}
        self.targets: dict[int, list[tuple[Batch, int | None]]] = {}

    def _consumers(self, ops: Sequence[str], targets: Sequence[int]) -> Consumers:
        return [(self.position[n], True) for n in ops] + [(t, False) for t in targets]

    def fold(self, op: OpSpec, folder: Folder) -> None:
        """Op ``op`` folds its input into ``folder`` (a combine or a process op)."""
        self.folders[self.position[op.name]] = folder

    # -- a chunk ----------------------------------------------------------------------

    def run(self, rows: Sequence[InRow]) -> None:
        """Run a chunk's rows through the stage."""
        if not rows:
            return
        inbounds, rids, tss, kbs, elems = (list(c) for c in zip(*rows, strict=True))
        self.out.hold_letters()
        try:
            redriven = self.spec.source is not None and Redrive in set(map(type, elems))
            if len(self.entries) == 1 and not redriven:
                batch = Batch(elems, rids, tss)
                if self.spec.inbound[0].keyed:
                    batch.kbs = kbs
                self._deliver(self.entries[0], batch)
            else:
                self._start_each(inbounds, rids, tss, kbs, elems)
            self._run()
        finally:
            self.inbox.clear()
            self.targets.clear()
        self.out.release_letters()

    def _start_each(
        self,
        inbounds: list[int],
        rids: list[bytes],
        tss: list[int],
        kbs: list[bytes | None],
        elems: list[Any],
    ) -> None:
        """Rows of several inbounds, or with records replayed from dead letters among them."""
        replayed = [e.__class__ is Redrive for e in elems]
        for inbound, entries in enumerate(self.entries):
            mine = [b == inbound and not r for b, r in zip(inbounds, replayed, strict=True)]
            where = list(compress(range(len(rids)), mine))
            if not where:
                continue
            batch = Batch(
                [elems[i] for i in where], [rids[i] for i in where], [tss[i] for i in where]
            )
            batch.base = where
            if self.spec.inbound[inbound].keyed:
                batch.kbs = [kbs[i] for i in where]
            self._deliver(entries, batch)
        for row in compress(range(len(rids)), replayed):
            self._redrive(row, elems[row], rids[row], tss[row])

    def _redrive(self, row: int, replayed: Redrive, rid: bytes, ts: int) -> None:
        """A record replayed from a dead letter goes straight to the node it failed in."""
        batch = Batch([replayed.value], [rid], [ts])
        batch.base = [row]
        at = self.position.get(replayed.node)
        if at is not None:
            self.inbox.setdefault(at, []).append((batch, 0))
            return
        cursor = self.cursor
        cursor.parent, cursor.ts = rid, ts
        self.out.keyer = lambda: (row,)
        self.out.unroutable(self.spec.name, replayed)

    def _deliver(self, consumers: Consumers, batch: Batch) -> None:
        if not batch.elems:
            return
        for rank, (at, is_op) in enumerate(consumers):
            box = self.inbox if is_op else self.targets
            box.setdefault(at, []).append((batch, rank))

    def _run(self) -> None:
        """Every op with input, in graph order; then the targets."""
        inbox = self.inbox
        for at, op in enumerate(self.ops):
            pieces = inbox.pop(at, None)
            if not pieces:
                continue
            batch, rank = pieces[0] if len(pieces) == 1 else (merged(pieces), None)
            folder = self.folders.get(at)
            if folder is not None:
                self._fold(op, folder, batch, rank)
                continue
            made = self._each(op, batch, rank)
            self._deliver(self.consumers[at], made)
        for target, pieces in sorted(self.targets.items()):
            batch = pieces[0][0] if len(pieces) == 1 else merged(pieces)
            self.out.add(target, batch.elems, batch.parents, batch.ts)

    def _place(self, batch: Batch, rank: int | None, i: int) -> None:
        """Point the cursor at element ``i`` (before its dead letter is made)."""
        cursor = self.cursor
        cursor.index = i
        cursor.parent = batch.parents[i]
        cursor.ts = batch.ts[i]

    def _each(self, op: OpSpec, batch: Batch, rank: int | None) -> Batch:
        """An element-wise op on a batch (its failures dead letters, in their place)."""
        cursor, out, name = self.cursor, self.out, op.name
        out.keyer = lambda: key_in(batch, rank, cursor.index)

        def fail(i: int, exc: BaseException) -> None:
            self._place(batch, rank, i)
            self.fail(name, exc, batch.elems[i])

        def ahead(i: int, ts: int) -> bool:
            newest = self.limit()
            if newest is None or ts <= newest:
                return False
            self._place(batch, rank, i)
            out.letter(name, ahead_reason(ts, newest), portable(batch.elems[i]), "ahead")
            return True

        return each.apply(op, batch, rank, fail, ahead)

    # -- combines and process ops -----------------------------------------------------

    def _fold(self, op: OpSpec, folder: Folder, batch: Batch, rank: int | None) -> None:
        """Fold a batch of ``(key, value)`` pairs into a combine or a process op."""
        cursor, out, name = self.cursor, self.out, op.name
        out.keyer = lambda: key_in(batch, rank, cursor.index)

        def fail(i: int, exc: BaseException) -> None:
            self._place(batch, rank, i)
            if isinstance(exc, WindowClosedError):
                out.letter(name, str(exc), portable(batch.elems[i]), "window_closed")
            else:
                self.fail(name, exc, batch.elems[i])

        if isinstance(folder, WindowedCombine):
            folder.closed_windows = lambda reason, part: out.letter(
                name, reason, portable(part), "window_closed"
            )
        keys, values, where = _pairs(batch.elems, fail)
        kbs, ok = _key_bytes(batch, keys, where, fail)
        if ok is not None:
            keys, values = [keys[j] for j in ok], [values[j] for j in ok]
            where = [where[j] for j in ok] if where is not None else ok
        ts, parents = batch.ts, batch.parents
        at: each.Fail = fail
        if where is not None:
            ts, parents = [batch.ts[i] for i in where], [batch.parents[i] for i in where]
            at = each.remapped(fail, where)
        if isinstance(folder, CombineOp):
            folder.add_many(kbs, keys, values, ts, at)
            return
        add = folder.add
        for j, kb in enumerate(kbs):
            cursor.index = where[j] if where is not None else j
            cursor.parent = parents[j]
            try:
                add(kb, keys[j], values[j], ts[j])
            except Exception as exc:  # noqa: BLE001 - user code or a bad element
                at(j, exc)

    # -- emissions --------------------------------------------------------------------

    def outlet(self, op: OpSpec) -> Callable[[Any], None]:
        """Where op ``op`` (a combine or a process op) emits, under the cursor's record."""
        at = self.position[op.name]
        emitter = self.emitted.get(at)
        if emitter is None:
            emitter = self.emitted[at] = Emitter(self.cursor, self.slots)
        return emitter.push

    @contextlib.contextmanager
    def emitting(self) -> Iterator[None]:
        """A step in which ops emit: what they emitted then runs on through the stage.

        Dead letters the step makes itself take their place among the emissions.
        """
        out = self.out
        out.hold_letters()
        self.slots.next = 0
        out.keyer = self.slots.letter
        try:
            yield
            for at, emitter in self.emitted.items():
                batch = emitter.take()
                if batch is not None:
                    self._deliver(self.consumers[at], batch)
            self._run()
        finally:
            self.inbox.clear()
            self.targets.clear()
            for emitter in self.emitted.values():
                emitter.take()
        out.release_letters()


class Slots:
    """The places of a step's emissions and of the dead letters it makes itself, in turn."""

    __slots__ = ("next",)

    def __init__(self) -> None:
        self.next = 0

    def take(self) -> int:
        """The next place."""
        n = self.next
        self.next = n + 1
        return n

    def letter(self) -> Key:
        """The key of a dead letter made now."""
        return (self.take(),)


class Emitter:
    """What one op emits in a step, with the cursor's parent and time for each element."""

    __slots__ = ("cursor", "elems", "parents", "places", "slots", "ts")

    def __init__(self, cursor: Cursor, slots: Slots) -> None:
        self.cursor = cursor
        self.slots = slots
        self.elems: list[Any] = []
        self.parents: list[bytes] = []
        self.ts: list[int] = []
        self.places: list[int] = []

    def push(self, elem: Any) -> None:
        """Emit one element under the cursor's record."""
        cursor = self.cursor
        self.elems.append(elem)
        self.parents.append(cursor.parent)
        self.ts.append(cursor.ts)
        self.places.append(self.slots.take())

    def take(self) -> Batch | None:
        """What was emitted, as a batch (None: nothing); the emitter starts empty again."""
        if not self.elems:
            return None
        batch = Batch(self.elems, self.parents, self.ts)
        batch.base = self.places
        self.elems, self.parents, self.ts, self.places = [], [], [], []
        return batch


def _pairs(
    elems: Sequence[Any], fail: Callable[[int, BaseException], None]
) -> tuple[list[Any], list[Any], list[int] | None]:
    """Keys and values of ``(key, value)`` elements; who was one (None: every element)."""
    if set(map(type, elems)) <= _PAIR and set(map(len, elems)) <= {2}:
        return [e[0] for e in elems], [e[1] for e in elems], None
    keys, values, where = [], [], []
    for i, elem in enumerate(elems):
        try:
            key, value = elem
        except Exception as exc:  # noqa: BLE001 - not a pair: as element by element
            fail(i, exc)
            continue
        keys.append(key)
        values.append(value)
        where.append(i)
    return keys, values, where


def _key_bytes(
    batch: Batch,
    keys: list[Any],
    where: list[int] | None,
    fail: Callable[[int, BaseException], None],
) -> tuple[list[bytes], list[int] | None]:
    """The keys encoded (as they arrived, from an exchange); which could be (None: all).

    ``where`` says which elements of the batch ``keys`` are (None: all of them); the result
    says which of ``keys`` (positions in it) could be encoded.
    """
    kbs = batch.kbs
    if kbs is not None and batch.up is None and None not in kbs:
        given = cast("Sequence[bytes]", kbs)
        return (list(given) if where is None else [given[i] for i in where]), None
    try:
        return codec.encode_many(keys), None
    except CodecError:
        pass
    found, kept = [], []
    for j, key in enumerate(keys):
        try:
            found.append(codec.encode(key))
        except Exception as exc:  # noqa: BLE001 - an unencodable key: its element's letter
            fail(where[j] if where is not None else j, exc)
            continue
        kept.append(j)
    return found, kept
