"""A chunk's elements at one point of a fused stage, as parallel lists, and where they came from.

A fused stage runs a chunk an op at a time (:mod:`~.flow`): each op takes the list of
elements its producer made, with their parents' IDs and event times beside them, and makes
its own lists. Nothing is kept per element but the lists; what an element descends from is
kept per batch (``up``, ``src``), and asked only where order must be decided: where two
producers feed one node, and for dead letters.

Order is the order a stage running one element at a time, depth first, would make (the order
outputs had before stages ran by chunk, on which their IDs depend: an output's ID counts the
outputs of its parent before it on the same boundary). An element's *key* says where it falls
in that order: the row it descends from, then at each op on its way the op's rank among its
producer's consumers and its position in the op's output. Keys compare as tuples.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Key = tuple[int, ...]


class Batch:
    """Elements with their parents' IDs and event times (index ``i`` of each is one element).

    ``up`` is the batch the producing op read (None: the elements enter here, at a row of
    the chunk or an emission, ``base`` numbering them; or ``keys`` gives each one's key),
    ``rank`` that op's rank among ``up``'s consumers (None: ``up``'s keys hold it already)
    and ``src`` which element of ``up`` each one came from (None: the i-th, one each).
    ``kbs``: the elements' encoded keys, when they arrived with them (rows of an exchange).
    """

    __slots__ = ("base", "elems", "kbs", "keys", "memo", "parents", "rank", "src", "ts", "up")

    def __init__(
        self,
        elems: Sequence[Any],
        parents: Sequence[bytes],
        ts: Sequence[int],
        up: Batch | None = None,
        rank: int | None = None,
        src: Sequence[int] | None = None,
    ) -> None:
        self.elems = elems
        self.parents = parents
        self.ts = ts
        self.up = up
        self.rank = rank
        self.src = src
        self.base: Sequence[int] | None = None
        self.keys: Sequence[Key] | None = None
        self.kbs: Sequence[bytes | None] | None = None
        self.memo: list[Key] | None = None

    def __len__(self) -> int:
        return len(self.elems)

    def pick(self, alive: Sequence[int]) -> tuple[list[bytes], list[int]]:
        """The parents and event times of the elements at ``alive``."""
        parents, ts = self.parents, self.ts
        return [parents[i] for i in alive], [ts[i] for i in alive]


def key_out(batch: Batch, j: int) -> Key:
    """Where element ``j`` of ``batch`` falls in the stage's order (see the module doc)."""
    if batch.keys is not None:
        return tuple(batch.keys[j])
    up = batch.up
    if up is None:
        return (batch.base[j] if batch.base is not None else j,)
    i = batch.src[j] if batch.src is not None else j
    return key_in(up, batch.rank, i) + (j,)


def key_in(batch: Batch, rank: int | None, i: int) -> Key:
    """The key of element ``i`` of ``batch`` as read by a consumer of rank ``rank``.

    It is also the key of a dead letter that consumer makes of the element: the letter takes
    the element's place in the order (a failing element has no outputs).
    """
    key = key_out(batch, i)
    return key if rank is None else (*key, rank)


def keys_out(batch: Batch) -> list[Key]:
    """:func:`key_out` of every element of ``batch`` (computed once per batch)."""
    if batch.memo is not None:
        return batch.memo
    n = len(batch.elems)
    if batch.keys is not None:
        found = [tuple(k) for k in batch.keys]
    elif batch.up is None:
        base = batch.base if batch.base is not None else range(n)
        found = [(b,) for b in base]
    else:
        above = keys_in(batch.up, batch.rank)
        src = batch.src if batch.src is not None else range(n)
        found = [(*above[i], j) for j, i in enumerate(src)]
    batch.memo = found
    return found


def keys_in(batch: Batch, rank: int | None) -> list[Key]:
    """:func:`key_in` of every element of ``batch``."""
    keys = keys_out(batch)
    return keys if rank is None else [(*k, rank) for k in keys]


def merged(pieces: Sequence[tuple[Batch, int | None]]) -> Batch:
    """One batch of several producers' elements, in the stage's order (keys kept with them)."""
    keyed: list[tuple[Key, Any, bytes, int]] = []
    for batch, rank in pieces:
        keyed += zip(keys_in(batch, rank), batch.elems, batch.parents, batch.ts, strict=True)
    keyed.sort(key=_first)
    out = Batch([k[1] for k in keyed], [k[2] for k in keyed], [k[3] for k in keyed])
    out.keys = [k[0] for k in keyed]
    return out


def _first(item: tuple[Key, Any, bytes, int]) -> Key:
    return item[0]
