"""What the PostgreSQL sink checks of its table before the first record, and how values fit.

Read once on the driver (:func:`read_table`): the table's columns with their types, and its
unique constraints and indexes. An upsert needs one whose columns are exactly
``key_columns`` (``INSERT ... ON CONFLICT (key_columns)`` names it); without one every row
would fail the same way, so the run is refused before it starts (:func:`check_upsert`).

Each value is then fitted to its column's type in the writer (:meth:`TableShape.fit`), so a
value that cannot be one is a dead letter saying so, before anything is sent:

=====================================  ==============================================
column type                            Python values
=====================================  ==============================================
``timestamptz``, ``timestamp``         ``datetime`` (naive: as written), ISO text, or
                                       an int of epoch milliseconds (UTC)
``date``                               ``date``, ``datetime`` (its date), ISO text
``json``, ``jsonb``                    any JSON value (dict, list, str, number ...)
``bytea``                              ``bytes``
``boolean``                            ``bool``
``smallint``, ``integer``, ``bigint``  ``int`` (not ``bool``)
``real``, ``double precision``,        ``int`` or ``float`` (``numeric`` also takes
``numeric``                            ``decimal.Decimal`` and text)
text types, ``uuid``, others           passed as they are; the server decides
=====================================  ==============================================

None is SQL NULL everywhere (a ``NOT NULL`` column refuses it: a dead letter).
"""

from __future__ import annotations

import decimal
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

from onceflow.connectors.errors import ConnectorError

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
TIMESTAMPS = frozenset({"timestamp", "timestamptz"})
INTEGERS = frozenset({"int2", "int4", "int8"})
FLOATS = frozenset({"float4", "float8"})
JSON = frozenset({"json", "jsonb"})
COLUMNS_SQL = (
    "SELECT a.attname, t.typname, a.attnotnull FROM pg_attribute a "
    "JOIN pg_type t ON t.oid = a.atttypid "
    "WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum"
)
UNIQUE_SQL = (
    "SELECT array_agg(a.attname::text ORDER BY a.attname) FROM pg_index i "
    "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
    "WHERE i.indrelid = %s::regclass AND i.indisunique AND i.indpred IS NULL "
    "GROUP BY i.indexrelid"
)


@dataclass(frozen=True)
class Column:
    """One column: its name, its type's name (``udt_name``: ``int8``, ``timestamptz`` ...)."""

    name: str
    type: str
    not_null: bool


@dataclass(frozen=True)
class TableShape:
    """The table's columns (in order) and the column sets of its unique constraints."""

    table: str
    columns: tuple[Column, ...]
    unique: tuple[frozenset[str], ...]

    @property
    def names(self) -> tuple[str, ...]:
        """The column names, in the table's order."""
        return tuple(c.name for c in self.columns)

    def fit(self, row: dict[str, Any]) -> dict[str, Any]:
        """The row with each value as its column takes it; ValueError says which does not."""
        types = {c.name: c.type for c in self.columns}
        return {name: fit_value(name, types[name], value) for name, value in row.items()}


def connect(conninfo: str, connection: dict[str, Any], what: str, **extra: Any) -> Any:
    """A new connection (psycopg 3) for ``what`` (a connector's one line); one line if it fails."""
    try:
        import psycopg
    except ImportError as exc:
        msg = f"{what.split(maxsplit=1)[0]} needs psycopg: pip install 'onceflow[postgres]'"
        raise ConnectorError(msg) from exc
    try:
        return psycopg.connect(conninfo, **{**connection, **extra})
    except psycopg.OperationalError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        msg = f"cannot connect to PostgreSQL for {what}: {first}"
        raise ConnectorError(msg) from None


def read_table(conn: Any, table: str) -> TableShape | None:
    """The table's shape (None: no such table in the search path)."""
    found = conn.execute("SELECT to_regclass(%s)", (_quoted(table),)).fetchone()
    if found is None or found[0] is None:
        return None
    oid = _quoted(table)
    columns = tuple(Column(n, t, bool(nn)) for n, t, nn in conn.execute(COLUMNS_SQL, (oid,)))
    unique = tuple(frozenset(cols) for (cols,) in conn.execute(UNIQUE_SQL, (oid,)))
    return TableShape(table, columns, unique)


def _quoted(table: str) -> str:
    return '"' + table.replace('"', '""') + '"'


def check_upsert(shape: TableShape, key_columns: tuple[str, ...]) -> None:
    """Refuse an upsert the table cannot take: no unique constraint on exactly its keys."""
    keys = frozenset(key_columns)
    if keys in shape.unique:
        return
    have = "; ".join("(" + ", ".join(sorted(u)) + ")" for u in shape.unique) or "none"
    cols = ", ".join(key_columns)
    msg = (
        f"PostgresSink(mode='upsert', key_columns={list(key_columns)}) needs a unique "
        f"constraint on exactly ({cols}) of table {shape.table!r}, which has: {have}; add one "
        f"(ALTER TABLE {shape.table} ADD PRIMARY KEY ({cols}), or UNIQUE ({cols})) or pass "
        "the key_columns of an existing one"
    )
    raise ConnectorError(msg)


def fit_value(column: str, kind: str, value: Any) -> Any:  # noqa: PLR0911 - one per type
    """``value`` as a column of type ``kind`` takes it (see the module docstring)."""
    if value is None:
        return None
    if kind in TIMESTAMPS:
        return _timestamp(column, kind, value)
    if kind == "date":
        return _date(column, value)
    if kind in JSON:
        from psycopg.types.json import Json, Jsonb

        return Jsonb(value) if kind == "jsonb" else Json(value)
    if isinstance(value, dict) or (isinstance(value, list | tuple) and not kind.startswith("_")):
        raise _unfit(column, kind, "a value, not a list or dict (those fit json columns)", value)
    if kind in INTEGERS and (isinstance(value, bool) or not isinstance(value, int)):
        raise _unfit(column, kind, "an int", value)
    if kind in FLOATS and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise _unfit(column, kind, "an int or a float", value)
    if kind == "numeric" and not isinstance(value, int | float | decimal.Decimal | str):
        raise _unfit(column, kind, "a number", value)
    if kind == "bool" and not isinstance(value, bool):
        raise _unfit(column, kind, "a bool", value)
    if kind == "bytea" and not isinstance(value, bytes | bytearray):
        raise _unfit(column, kind, "bytes", value)
    return value


def _timestamp(column: str, kind: str, value: Any) -> Any:
    if isinstance(value, datetime | str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        at = _EPOCH + timedelta(milliseconds=value)
        return at if kind == "timestamptz" else at.replace(tzinfo=None)
    raise _unfit(column, kind, "a datetime, ISO text or epoch milliseconds (int)", value)


def _date(column: str, value: Any) -> Any:
    if isinstance(value, datetime):
        return value.date()
    if isinstance(value, date | str):
        return value
    raise _unfit(column, "date", "a date, a datetime or ISO text", value)


def _unfit(column: str, kind: str, wanted: str, value: Any) -> ValueError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:60] + "..."
    return ValueError(f"column {column!r} is {kind}: expected {wanted}, got {shown}")
