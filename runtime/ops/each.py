"""Element-wise ops applied to a chunk's list of elements at once.

``map``, ``filter``, ``flat_map``, ``key_by``, ``map_values`` (and ``map_timestamped``,
``restamp``, and the pass-through of merges and windows) take a :class:`~.batch.Batch` and
make the next: the user's function runs over the list in one ``map`` (a C loop: no call of
ours per element), and the parents' IDs and event times follow as lists. An element whose
function raises becomes a dead letter (through ``fail``) and the loop goes on with the next
one, each element's function called once: ``list.extend`` keeps what ``map`` gave before the
exception, and the iterator stands after the element that failed (:func:`call_all`). What
each op makes is what calling it element by element made: the same outputs in the same order,
the same failures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from itertools import chain, compress, repeat
from operator import itemgetter
from typing import Any

from onceflow.kernel.eventtime import as_event_time
from onceflow.runtime.ops.batch import Batch
from onceflow.runtime.spec import Each, OpSpec

Fail = Callable[[int, BaseException], None]  # element i of the input failed with the error
Ahead = Callable[[int, int], bool]  # element i stamped ts: too far ahead (then a letter)?
_FIRST, _SECOND = itemgetter(0), itemgetter(1)
_SEQUENCES = frozenset((list, tuple))


def call_all(
    fn: Callable[..., Any], columns: Sequence[Sequence[Any]], fail: Fail
) -> tuple[list[Any], list[int] | None]:
    """``fn`` of every element (of the columns zipped); the results and who gave one.

    Returns the results of the elements that did not raise, in order, and the indices of
    those elements (None: every one). Each failure is handed to ``fail`` with its index.
    A ``StopIteration`` out of ``fn`` ends ``map`` without an error: the element it came
    from is then called alone (it raises again as an error, or gives its result).
    """
    n = len(columns[0])
    its: list[Iterator[Any]] = [iter(c) for c in columns]
    out: list[Any] = []
    failed: list[int] = []
    while True:
        try:
            out.extend(map(fn, *its))
        except Exception as exc:  # noqa: BLE001 - user code: the element is a dead letter
            at = len(out) + len(failed)
            failed.append(at)
            fail(at, exc)
            continue
        at = len(out) + len(failed)
        if at >= n:
            break
        try:  # a StopIteration ended the map at element ``at``
            out.append(fn(*(c[at] for c in columns)))
        except Exception as exc:  # noqa: BLE001 - user code
            failed.append(at)
            fail(at, exc)
    if not failed:
        return out, None
    gone = set(failed)
    return out, [i for i in range(n) if i not in gone]


def remapped(fail: Fail, where: Sequence[int]) -> Fail:
    """``fail`` for a list of some of a batch's elements (``where`` says which)."""

    def at(j: int, exc: BaseException) -> None:
        fail(where[j], exc)

    return at


def apply(op: OpSpec, batch: Batch, rank: int | None, fail: Fail, ahead: Ahead) -> Batch:
    """The batch op ``op`` makes of ``batch`` (read at ``rank``; see :mod:`~.batch`)."""
    if op.restamp:
        return _restamp(op, batch, rank, fail, ahead)
    if op.each is Each.PASS:
        return Batch(batch.elems, batch.parents, batch.ts, batch, rank)
    assert op.fn is not None
    if op.each is Each.MAP_VALUES:
        return _map_values(op.fn, batch, rank, fail)
    columns = (batch.elems, batch.ts) if op.timestamped else (batch.elems,)
    results, alive = call_all(op.fn, columns, fail)
    return _SHAPES[op.each](results, batch, rank, alive, fail)


def _map(
    results: list[Any], batch: Batch, rank: int | None, alive: list[int] | None, fail: Fail
) -> Batch:
    """A map's results are its outputs."""
    return _out(results, batch, rank, alive)


def _key_by(
    results: list[Any], batch: Batch, rank: int | None, alive: list[int] | None, fail: Fail
) -> Batch:
    """``(key, element)`` of every element a key was found for."""
    elems = batch.elems if alive is None else [batch.elems[i] for i in alive]
    return _out(list(zip(results, elems, strict=True)), batch, rank, alive)


def _out(elems: list[Any], batch: Batch, rank: int | None, alive: list[int] | None) -> Batch:
    """One output per surviving element."""
    if alive is None:
        return Batch(elems, batch.parents, batch.ts, batch, rank)
    parents, ts = batch.pick(alive)
    return Batch(elems, parents, ts, batch, rank, alive)


def _filter(
    tests: list[Any], batch: Batch, rank: int | None, alive: list[int] | None, fail: Fail
) -> Batch:
    """The elements whose test is true (a test whose truth raises: a dead letter)."""
    where: Sequence[int] = range(len(batch.elems)) if alive is None else alive
    elems = batch.elems if alive is None else [batch.elems[i] for i in alive]
    try:
        keep = list(map(bool, tests))
    except Exception:  # noqa: BLE001 - a test's __bool__ raised: find it
        keep = []
        for i, test in zip(where, tests, strict=True):
            try:
                keep.append(bool(test))
            except Exception as exc:  # noqa: BLE001 - user code
                keep.append(False)
                fail(i, exc)
    src = list(compress(where, keep))
    parents, ts = batch.pick(src)
    return Batch(list(compress(elems, keep)), parents, ts, batch, rank, src)


def _flat(
    results: list[Any], batch: Batch, rank: int | None, alive: list[int] | None, fail: Fail
) -> Batch:
    """The items of every surviving element's result, in order."""
    where: Sequence[int] = range(len(batch.elems)) if alive is None else alive
    if not set(map(type, results)) <= _SEQUENCES:
        where, results = _as_sequences(where, results, fail)
    counts = list(map(len, results))
    elems = list(chain.from_iterable(results))
    if len(where) == len(batch.elems) and counts.count(1) == len(counts):
        return Batch(elems, batch.parents, batch.ts, batch, rank)  # one output each
    src = list(chain.from_iterable(map(repeat, where, counts)))
    parents, ts = batch.pick(src)
    return Batch(elems, parents, ts, batch, rank, src)


def _as_sequences(
    where: Sequence[int], results: list[Any], fail: Fail
) -> tuple[list[int], list[Any]]:
    """Results that are neither lists nor tuples as lists (iterating one may raise)."""
    kept: list[int] = []
    lists: list[Any] = []
    for i, result in zip(where, results, strict=True):
        if isinstance(result, tuple | list):
            kept.append(i)
            lists.append(result)
            continue
        try:
            lists.append(list(result))
        except Exception as exc:  # noqa: BLE001 - user code (a generator, say)
            fail(i, exc)
            continue
        kept.append(i)
    return kept, lists


def _map_values(fn: Callable[..., Any], batch: Batch, rank: int | None, fail: Fail) -> Batch:
    """``(key, fn(value))`` of every ``(key, value)`` pair."""
    elems = batch.elems
    try:
        keys = list(map(_FIRST, elems))
        values = list(map(_SECOND, elems))
        where: list[int] | None = None
    except Exception:  # noqa: BLE001 - an element that is no pair: find it
        keys, values, where = [], [], []
        for i, kv in enumerate(elems):
            try:
                key, value = kv[0], kv[1]
            except Exception as exc:  # noqa: BLE001 - the element, as element by element
                fail(i, exc)
                continue
            keys.append(key)
            values.append(value)
            where.append(i)
    at = remapped(fail, where) if where is not None else fail
    results, alive = call_all(fn, (values,), at)
    if alive is not None:
        keys = [keys[j] for j in alive]
        alive = [where[j] for j in alive] if where is not None else alive
    else:
        alive = where
    return _out(list(zip(keys, results, strict=True)), batch, rank, alive)


def _restamp(op: OpSpec, batch: Batch, rank: int | None, fail: Fail, ahead: Ahead) -> Batch:
    """Each element with the event time ``fn(element)`` (see :meth:`Stream.restamp`)."""
    assert op.fn is not None
    fn = op.fn
    elems, stamps, alive = [], [], []
    for i, elem in enumerate(batch.elems):
        try:
            ts = as_event_time(fn(elem))
        except Exception as exc:  # noqa: BLE001 - user code: dead-letter it
            fail(i, exc)
            continue
        if ahead(i, ts):
            continue
        elems.append(elem)
        stamps.append(ts)
        alive.append(i)
    parents, _ = batch.pick(alive)
    return Batch(elems, parents, stamps, batch, rank, alive)


_SHAPES = {Each.MAP: _map, Each.KEY_BY: _key_by, Each.FILTER: _filter, Each.FLAT: _flat}
