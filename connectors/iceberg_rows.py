"""Rows into Arrow for the Iceberg sink.

A new table's schema from its first rows, a delivery's rows converted to the table's schema,
and why a row does not fit it (its dead letter's reason).
"""

from __future__ import annotations

from typing import Any

ID_COLUMN = "_onceflow_id"


def convert(rows: list[dict[str, Any]], schema: Any) -> Any:
    """The rows as one Arrow table of ``schema``, or None if any row does not fit it."""
    import pyarrow as pa

    names = set(schema.names)
    if not set().union(*rows) <= names:
        return None
    try:
        arrow = pa.Table.from_pylist(rows, schema=schema)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return None
    for field, column in zip(schema, arrow.columns, strict=True):
        if not field.nullable and column.null_count:
            return None
    return arrow


Fitted = tuple[Any, list[int], list[tuple[int, str]]]  # Arrow rows, their places, faults


def fitting(rows: list[dict[str, Any]], schema: Any) -> Fitted:
    """The rows that fit ``schema`` (one Arrow table; None: none), where, and why not the rest.

    The result is the Arrow table, the place in ``rows`` of each of its rows, and for each
    other row its place and why it does not fit. The rows are converted together; only if
    that fails is each tried alone, to find the ones at fault. Raises ``ValueError`` if rows
    that each fit alone do not fit together (no row's fault).
    """
    arrow = convert(rows, schema)
    if arrow is not None:
        return arrow, list(range(len(rows))), []
    kept: list[int] = []
    faults: list[tuple[int, str]] = []
    for i, row in enumerate(rows):
        reason = fault(row, schema)
        if reason is None:
            kept.append(i)
        else:
            faults.append((i, reason))
    if not kept:
        return None, [], faults
    together = convert([rows[i] for i in kept], schema)
    if together is None:
        msg = "rows that fit the table alone do not fit it together"
        raise ValueError(msg)
    return together, kept, faults


def fault(row: dict[str, Any], schema: Any) -> str | None:
    """Why ``row`` does not fit ``schema`` (None if it does)."""
    import pyarrow as pa

    unknown = [c for c in row if c not in schema.names]
    if unknown:
        return f"no column(s) {', '.join(map(repr, unknown))}"
    missing = [f.name for f in schema if not f.nullable and row.get(f.name) is None]
    if missing:
        return f"required column(s) {', '.join(map(repr, missing))} missing"
    try:
        pa.Table.from_pylist([row], schema=schema)
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return None


def inferred(rows: Any, with_ids: bool) -> Any:
    """An Arrow schema for a new table from the first rows (None without rows)."""
    import pyarrow as pa

    if not rows:
        return None
    try:
        schema = pa.Table.from_pylist(rows).schema
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        schema = unified(rows)  # rows that clash: the types most of them fit, row by row
        if schema is None:
            return None
    fields = [pa.field(f.name, pa.string()) if pa.types.is_null(f.type) else f for f in schema]
    if with_ids and ID_COLUMN not in schema.names:
        fields.append(pa.field(ID_COLUMN, pa.string()))
    return pa.schema(fields)


def unified(rows: list[dict[str, Any]]) -> Any:
    """The rows' Arrow types widened row by row; a row that fits no widening is left out.

    Only when the rows do not convert together: the rows left out become dead letters when
    they are checked against the new table.
    """
    import pyarrow as pa

    schema = None
    for row in rows:
        try:
            one = pa.Table.from_pylist([row]).schema
            both = [one] if schema is None else [schema, one]
            schema = pa.unify_schemas(both, promote_options="permissive")
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            continue
    return schema
