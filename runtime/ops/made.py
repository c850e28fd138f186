"""Sink records from the elements a stage made, where that is provably what the backup holds.

A sink writes elements, not bytes: an output's element is what decoding its encoded value
gives, and that is what a retry writes (it replays the output from the backup). The stage
still holds the element it encoded, so decoding it again is work for nothing when the element
*is* what decoding would give: when it is made of plain values only (``None``, ``bool``,
``int``, ``float``, ``str``, ``bytes``, ``list``, ``dict``, exactly those types: they come back
from MessagePack as they went in) and still encodes to the output's bytes (nothing changed it
since: a function may keep and change what it returned). Both are checked at once, by
encoding the element again with a packer that refuses anything but those types and comparing
the bytes; an element that fails the check, and every output replayed from a backup, is
decoded as before. So the first attempt writes, byte for byte, what a retry would.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import repeat
from operator import eq, itemgetter
from typing import Any

import msgpack

from onceflow.kernel import codec
from onceflow.kernel.records import Output, Record
from onceflow.runtime.spec import TargetKind, TargetSpec


class Made:
    """The elements of sink outputs a task made and has not delivered, by output."""

    def __init__(self) -> None:
        self.elements: dict[int, tuple[Output, Any]] = {}  # id() of an output -> it, element
        self.chunk: list[int] = []  # outputs of the chunk under way (dropped if it is redone)
        self.keeping = True  # False: another job delivers them, from the backup
        self._plain = msgpack.Packer(use_bin_type=True, strict_types=True)

    def keep(self, outputs: Sequence[Output], elems: Sequence[Any]) -> None:
        """Remember the elements ``outputs`` (of one sink target) were encoded from."""
        if not self.keeping:
            return
        found = list(map(id, outputs))
        self.elements.update(zip(found, zip(outputs, elems, strict=True), strict=True))
        self.chunk += found

    def chunk_committed(self) -> None:
        """The chunk's outputs are backed up: their elements stay until delivered."""
        self.chunk = []

    def reset_chunk(self) -> None:
        """The chunk will be redone: its outputs are gone, and so are their elements."""
        for key in self.chunk:
            self.elements.pop(key, None)
        self.chunk = []

    def records(self, outputs: Sequence[Output], target: TargetSpec) -> list[Record]:
        """The sink records of ``outputs``: their elements where provably the same, else decoded."""
        held = list(map(self.elements.pop, map(id, outputs), repeat(None)))
        if held.count(None) == len(held):
            return decode_outputs(outputs, target)
        elems = [
            h[1] if h is not None and h[0] is o else _MISSING
            for o, h in zip(outputs, held, strict=True)
        ]
        keyed = target.keyed and target.kind is not TargetKind.DEAD
        same = self._same(outputs, elems, keyed)
        rows = [
            (o.id, o.ts, e if ok else _decoded(o, keyed), None, None, False, 0, 0)
            for o, e, ok in zip(outputs, elems, same, strict=True)
        ]
        return list(map(tuple.__new__, repeat(Record), rows))  # Record(*row), no call each

    def _same(self, outputs: Sequence[Output], elems: list[Any], keyed: bool) -> list[bool]:
        """Per output: its element is plain and encodes to its bytes."""
        if keyed:
            keys = self._packed([e[0] if e is not _MISSING else _MISSING for e in elems])
            values = self._packed([e[1] if e is not _MISSING else _MISSING for e in elems])
            return [
                k is not None and v is not None and k == o.key and v == o.value
                for o, k, v in zip(outputs, keys, values, strict=True)
            ]
        packed = self._packed(elems)
        return list(map(eq, packed, map(_VALUE, outputs)))

    def _packed(self, values: list[Any]) -> list[bytes | None]:
        """Each value packed if made of plain values only (None: it is not, or missing)."""
        pack = self._plain.pack
        try:
            return list(map(pack, values))
        except Exception:  # noqa: BLE001 - not all plain: one by one
            self._plain = msgpack.Packer(use_bin_type=True, strict_types=True)
        found: list[bytes | None] = []
        for value in values:
            try:
                found.append(self._plain.pack(value))
            except Exception:  # noqa: BLE001 - not plain (or missing): decoded instead
                self._plain = msgpack.Packer(use_bin_type=True, strict_types=True)
                found.append(None)
        return found


class _Missing:
    """No element held for an output (it is decoded); never plain."""


_MISSING = _Missing()
_VALUE = itemgetter(4)


def _decoded(output: Output, keyed: bool) -> Any:
    """An output's element, decoded from its bytes (a replayed one's, or one not plain)."""
    if keyed:
        assert output.key is not None
        return (codec.decode(output.key), codec.decode(output.value))
    return codec.decode(output.value)


def decode_outputs(outputs: Iterable[Output], target: TargetSpec) -> list[Record]:
    """Sink records back from their encoded form (sinks write elements, not bytes)."""
    decode = codec.decode
    if target.keyed and target.kind is not TargetKind.DEAD:
        return [Record(o.id, o.ts, (decode(o.key), decode(o.value))) for o in outputs]  # type: ignore[arg-type]
    return [Record(o.id, o.ts, decode(o.value)) for o in outputs]
