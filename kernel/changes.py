"""A row change of a database table: what change data capture gives a pipeline.

A :class:`Change` is a record value like any other (it crosses stage boundaries, backups and
state as its fields, see :mod:`onceflow.kernel.record_types`; registered here so that every
worker can read one, whatever it imported). Made by the Debezium format of the Kafka source
(:mod:`onceflow.connectors.debezium`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from crc32c import crc32c

from onceflow.kernel import record_types

INSERT, UPDATE, DELETE, READ, TRUNCATE, MESSAGE = (
    "insert",
    "update",
    "delete",
    "read",
    "truncate",
    "message",
)


@dataclass(frozen=True)
class Change:
    """One change of one row.

    ``op``: insert, update, delete, read (a row of a snapshot), truncate or message.
    ``key``: the row's primary key columns (``{"id": 7}``); ``before``/``after``: the row
    before and after the change (None where it did not exist; ``before`` holds only the key
    unless the table's replica identity is full); ``table``: ``schema.table``; ``ts_ms``: when
    the database committed it (a snapshot's rows: when they were read); ``position``: where
    in the database's log it is (PostgreSQL: ``lsn=...,txId=...``); ``transaction``: its
    transaction's id, when known.
    """

    op: str
    table: str
    key: dict[str, Any] | None
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    ts_ms: int
    position: str
    transaction: str | None = None

    @property
    def row(self) -> dict[str, Any] | None:
        """The row as it is now: ``after``, None once deleted (or truncated)."""
        return self.after

    @property
    def key_value(self) -> Any:
        """The key as one value: the column's value for a one-column key, else a tuple.

        ``changes.map(lambda c: (c.key_value, c.row))`` is a keyed stream of the table's
        current rows, a delete being ``(key, None)``: what the sinks write as an upsert or a
        delete (a Kafka tombstone, a PostgreSQL DELETE).
        """
        if not self.key:
            return None
        values = tuple(self.key.values())
        return values[0] if len(values) == 1 else values


record_types.register([Change])


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def change_id(change: Any) -> str | None:
    """What identifies a change, as text (made an ID by :func:`onceflow.kernel.ids.from_user_key`).

    A streamed change: its table, place in the database's log, key and operation (a re-sent
    copy has the same); a snapshot's row (``read``): its table, key and row, so that a snapshot
    taken again re-reads an unchanged row as a copy and a changed one as a new fact. Only a
    :class:`Change` has one: for anything else the source's default ID applies.
    """
    if not isinstance(change, Change):
        return None
    key = _canonical(change.key)
    if change.op == READ:
        return _canonical(("read", change.table, key, _canonical(change.after)))
    return _canonical(("change", change.table, change.position, key, change.op))


def change_time(change: Any) -> int:
    """A change's event time: when its database committed it (milliseconds)."""
    return change.ts_ms  # type: ignore[no-any-return]


def content_print(change: Any) -> int:
    """A checksum of what a :class:`Change` says (never 0): tells an ID conflict from a copy."""
    text = _canonical((change.op, change.table, change.key, change.before, change.after))
    return crc32c(text.encode()) or 1
