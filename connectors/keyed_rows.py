"""A keyed stream's rows for a table sink: upserts named by ``key_columns``, and deletes.

On a keyed stream ``(key, row)`` is the row of ``key`` and ``(key, None)`` deletes it: the
PostgreSQL and Iceberg sinks read both this way (``mode="upsert"``, ``key_columns=[...]``),
and so does the Kafka sink (a tombstone). The key fills the key columns a row lacks (a tuple
key several, in order); without ``key_columns`` it is the row's ``key`` column.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from onceflow.connectors.errors import ConnectorError


def check_mode(sink: str, mode: str, modes: Sequence[str], key_columns: Sequence[str]) -> None:
    """One line for a mode the sink has not, or an upsert that names no key columns."""
    if mode not in modes:
        msg = f"{sink} mode must be one of {', '.join(modes)}, got {mode!r}"
        raise ConnectorError(msg)
    if mode == "upsert" and not key_columns:
        msg = f"{sink}(mode='upsert') needs key_columns: the columns that name a row"
        raise ConnectorError(msg)


Key = tuple[Any, ...]


class Delete(dict[str, Any]):
    """``(key, None)`` on a keyed stream: the key columns' values of the row to delete."""


def key_values(key: Any, key_columns: Sequence[str]) -> Key:
    """A stream's key as the values of ``key_columns`` (a tuple key fills several, in order)."""
    return key if len(key_columns) > 1 and isinstance(key, tuple) else (key,)


def keyed_row(row: dict[str, Any], key: Any, key_columns: Sequence[str]) -> dict[str, Any]:
    """A keyed stream's row with its key: in the ``key_columns`` it lacks, else in ``key``.

    Without ``key_columns`` the key is the ``key`` column, unless the row has one.
    """
    if not key_columns:
        return row if "key" in row else {"key": key, **row}
    values = key_values(key, key_columns)
    if len(values) != len(key_columns):
        return row  # the row lacks key columns the key cannot fill: said by upsert_row
    filled = {c: v for c, v in zip(key_columns, values, strict=True) if c not in row}
    return {**filled, **row}


def upsert_row(row: dict[str, Any], key_columns: Sequence[str]) -> dict[str, Any]:
    """``row`` if it names its key (raises ``ValueError`` saying which key columns it lacks)."""
    missing = [c for c in key_columns if row.get(c) is None]
    if missing:
        msg = f"key column(s) {', '.join(map(repr, missing))} missing: an upsert names its row"
        raise ValueError(msg)
    return row


def delete_row(key: Any, key_columns: Sequence[str]) -> Delete:
    """``(key, None)``: the row to delete, named by the stream's key (its ``key_columns``)."""
    values = key_values(key, key_columns)
    if len(values) != len(key_columns) or any(v is None for v in values):
        msg = f"a delete's key {key!r} does not name the row's key_columns {list(key_columns)}"
        raise ValueError(msg)
    return Delete(zip(key_columns, values, strict=True))
