"""PostgreSQL's logical replication messages (``pgoutput``, protocol version 1) as changes.

:class:`Decoder` reads the binary messages ``pg_logical_slot_peek_binary_changes`` returns, in
order, and gives a :class:`~onceflow.kernel.changes.Change` per row change of a transaction
whose commit lies in a range of the log. It keeps what it learns of each table (the
``Relation`` messages: columns, types, which are the key) across transactions, since a table is
described once per decoding session, possibly in a transaction outside the range.

Column values come as text and become Python values by type: integers, floats and booleans as
such, ``json``/``jsonb`` parsed, everything else (numeric, dates, times, UUIDs, arrays ...) as
PostgreSQL writes it as text, so that a value is the same whichever way it was read (a
snapshot reads columns ``::text`` through :func:`value_of` too). A TOASTed value an update did
not change is not sent: the change's ``after`` leaves that column out.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from onceflow.kernel import changes
from onceflow.kernel.changes import Change

SNAPSHOT_PREFIX = "snapshot:"  # a range row whose "topic" names a snapshot to read
# 2000-01-01 (PostgreSQL's epoch) in Unix milliseconds
PG_EPOCH_MS = 946_684_800_000
_INTS = frozenset((20, 21, 23, 26))  # int8, int2, int4, oid
_FLOATS = frozenset((700, 701))  # float4, float8
_BOOL, _JSON, _JSONB = 16, 114, 3802
_OPS = {ord("I"): changes.INSERT, ord("U"): changes.UPDATE, ord("D"): changes.DELETE}


def lsn_text(lsn: int) -> str:
    """An LSN as PostgreSQL writes it (``16/B374D848``)."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def parse_lsn(text: str) -> int:
    """``16/B374D848`` as a number."""
    high, _, low = text.partition("/")
    return (int(high, 16) << 32) | int(low, 16)


def value_of(text: str | None, type_oid: int) -> Any:
    """A column's text value as a Python value (see the module docstring)."""
    if text is None:
        return None
    if type_oid in _INTS:
        return int(text)
    if type_oid in _FLOATS:
        return float(text)
    if type_oid == _BOOL:
        return text == "t"
    if type_oid in (_JSON, _JSONB):
        return json.loads(text)
    return text


@dataclass(frozen=True)
class Relation:
    """A table as its ``Relation`` message describes it."""

    name: str  # schema.table
    columns: tuple[str, ...]
    types: tuple[int, ...]
    keys: tuple[str, ...]


class _Reader:
    """Big-endian fields of one message, in order."""

    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.data, self.at)
        self.at += struct.calcsize(fmt)
        return value[0]

    def text(self) -> str:
        end = self.data.index(b"\0", self.at)
        value = self.data[self.at : end].decode()
        self.at = end + 1
        return value

    def tuple_data(self, relation: Relation) -> dict[str, Any]:
        """A ``TupleData``: the columns sent (an unchanged TOASTed value is left out)."""
        row: dict[str, Any] = {}
        for i in range(self.take(">h")):
            kind = self.data[self.at]
            self.at += 1
            name, oid = relation.columns[i], relation.types[i]
            if kind == ord("n"):
                row[name] = None
            elif kind in (ord("t"), ord("b")):
                size = self.take(">i")
                raw = self.data[self.at : self.at + size]
                self.at += size
                row[name] = value_of(raw.decode(), oid) if kind == ord("t") else bytes(raw)
        return row


@dataclass
class _Transaction:
    commit_lsn: int
    ts_ms: int
    xid: int
    seen: int = 0  # row changes so far: the next one's number in the transaction


class Decoder:
    """Changes of the transactions committed in ``[start, end)`` (LSNs), from raw messages."""

    def __init__(self) -> None:
        self.relations: dict[int, Relation] = {}
        self.txn: _Transaction | None = None

    def changes(self, messages: Iterator[bytes], start: int, end: int) -> Iterator[Change]:
        """Each row change of a transaction whose commit LSN is in ``[start, end)``."""
        for message in messages:
            change = self.message(bytes(message))
            if change is not None and self.txn is not None and start <= self.txn.commit_lsn < end:
                yield change

    def message(self, data: bytes) -> Change | None:
        """Read one message; the change it is, if it is one."""
        kind, body = data[0], _Reader(data)
        body.at = 1
        if kind == ord("B"):
            lsn, ts_us, xid = body.take(">Q"), body.take(">q"), body.take(">I")
            self.txn = _Transaction(lsn, PG_EPOCH_MS + ts_us // 1000, xid)
        elif kind == ord("R"):
            self._relation(body)
        elif kind in _OPS:
            return self._row_change(_OPS[kind], body)
        elif kind == ord("T"):
            return self._truncate(body)
        return None  # Commit, Origin, Type, Message: nothing a row changed

    def _relation(self, body: _Reader) -> None:
        oid = body.take(">I")
        schema, table = body.text(), body.text()
        body.take(">b")  # replica identity
        columns, types, keys = [], [], []
        for _ in range(body.take(">h")):
            flags, name = body.take(">b"), body.text()
            types.append(body.take(">I"))
            body.take(">i")  # type modifier
            columns.append(name)
            if flags & 1:
                keys.append(name)
        self.relations[oid] = Relation(
            f"{schema}.{table}", tuple(columns), tuple(types), tuple(keys)
        )

    def _row_change(self, op: str, body: _Reader) -> Change:
        relation = self.relations[body.take(">I")]
        before = after = None
        kind = body.take(">c")
        if kind in (b"K", b"O"):  # the old row: its key (K) or all of it (replica identity full)
            before = body.tuple_data(relation)
            if op == changes.UPDATE:
                kind = body.take(">c")
        if kind == b"N":
            after = body.tuple_data(relation)
        row = after if after is not None else before or {}
        key = {k: row.get(k) for k in relation.keys} if relation.keys else None
        return self._change(op, relation.name, key, before, after)

    def _truncate(self, body: _Reader) -> Change | None:
        count = body.take(">i")
        body.take(">b")  # options
        names = [self.relations[body.take(">I")].name for _ in range(count)]
        return self._change(changes.TRUNCATE, ",".join(names), None, None, None)

    def _change(self, op: str, table: str, key: Any, before: Any, after: Any) -> Change:
        txn = self.txn
        if txn is None:
            msg = "a row change outside a transaction: the messages are not pgoutput's, in order"
            raise ValueError(msg)
        txn.seen += 1
        position = f"lsn={txn.commit_lsn},txId={txn.xid},n={txn.seen}"
        return Change(op, table, key, before, after, txn.ts_ms, position, str(txn.xid))
