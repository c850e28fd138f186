"""Upserts and deletes for the Iceberg sink (``mode="upsert"``): a delivery's last change per key.

On a keyed stream ``(key, row)`` upserts the row its ``key_columns`` name and ``(key, None)``
deletes it. A delivery keeps the last change of each key (:class:`Changes`); its commit is one
snapshot that removes every row of the table whose key columns equal one of the delivery's keys
(upserted or deleted alike) and adds the delivery's upserted rows.

pyiceberg 0.12 writes no delete files (a table asking for merge-on-read gets copy-on-write,
and its scan refuses equality deletes), so the removal is copy-on-write: each data file holding
such a key is replaced, in that same snapshot, by a file of its other rows (:func:`rewrites`).
Which files those are depends on the table's head, so they are found anew at every try of the
commit, on the head that try's compare-and-swap asserts; the delivery's own rows are written
once, in ``prepare``.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Sequence
from typing import Any

from onceflow.connectors.iceberg_rows import fitting
from onceflow.connectors.keyed_rows import Delete

Key = tuple[Any, ...]


class Changes:
    """One delivery's changes, the last per key: the rows to add and the keys to remove."""

    def __init__(self, key_columns: Sequence[str]) -> None:
        self.key_columns = tuple(key_columns)
        self.batches: list[Any] = []  # Arrow tables of the table's schema
        self.size = 0  # rows in the batches
        self.last: dict[Key, int | None] = {}  # key -> its last row among the batches' (None: gone)
        self.key_schema: Any = None

    def put(self, rows: list[dict[str, Any]], schema: Any) -> list[tuple[int, str]]:
        """Take rows and :class:`Delete` s (in the stream's order); why each refused one is.

        Keys are compared as the table's types make them (``1`` and ``1.0`` are one key of a
        ``long`` column). Raises ``ValueError`` if rows that fit alone do not fit together.
        """
        import pyarrow as pa

        self.key_schema = pa.schema([schema.field(c) for c in self.key_columns])
        upserts = [i for i, row in enumerate(rows) if not isinstance(row, Delete)]
        deletes = [i for i, row in enumerate(rows) if isinstance(row, Delete)]
        added, kept, faults = fitting([rows[i] for i in upserts], schema)
        gone, kept_deletes, delete_faults = fitting([rows[i] for i in deletes], self.key_schema)
        changes: list[tuple[int, Key, int | None]] = [
            (upserts[k], key, self.size + n)
            for n, (k, key) in enumerate(zip(kept, self._keys(added), strict=True))
        ]
        changes += [
            (deletes[k], key, None) for k, key in zip(kept_deletes, self._keys(gone), strict=True)
        ]
        for _position, key, row in sorted(changes, key=lambda change: change[0]):
            self.last[key] = row
        if added is not None:
            self.batches.append(added)
            self.size += added.num_rows
        return [(upserts[i], why) for i, why in faults] + [
            (deletes[i], why) for i, why in delete_faults
        ]

    def _keys(self, arrow: Any) -> list[Key]:
        if arrow is None:
            return []
        return list(zip(*(arrow.column(c).to_pylist() for c in self.key_columns), strict=True))

    def take(self) -> tuple[Any, Any]:
        """The rows to add (None: none) and the keys to remove (an Arrow table; None: none).

        Every key of the delivery is removed, the upserted ones too (their new rows are added
        in the same snapshot). The changes are forgotten.
        """
        import pyarrow as pa

        rows = keys = None
        keep = sorted(n for n in self.last.values() if n is not None)
        if keep:
            rows = pa.concat_tables(self.batches).take(keep)
        if self.last:
            named = [dict(zip(self.key_columns, key, strict=True)) for key in self.last]
            keys = pa.Table.from_pylist(named, schema=self.key_schema)
        self.clear()
        return rows, keys

    def clear(self) -> None:
        """Forget the changes (an aborted delivery)."""
        self.batches = []
        self.size = 0
        self.last = {}


def rewrites(table: Any, keys: Any, key_columns: Sequence[str]) -> tuple[list[Any], list[Any]]:
    """The data files of ``table``'s head holding one of ``keys``, and files of their other rows.

    Copy-on-write, as pyiceberg's own ``delete`` (which cannot share one snapshot with an
    append): a file is read (its position deletes applied), and if some of its rows have one
    of the keys it is replaced by a file of the others (or by none). Files the keys' values
    rule out (partitions, column bounds) are not read.
    """
    from pyiceberg.expressions import AlwaysTrue
    from pyiceberg.io.pyarrow import ArrowScan, _dataframe_to_data_files

    meta = table.metadata
    removed: list[Any] = []
    added: list[Any] = []
    write_uuid, counter = uuid.uuid4(), itertools.count()
    for task in table.scan(row_filter=candidates(keys, key_columns)).plan_files():
        rows = ArrowScan(meta, table.io, meta.schema(), AlwaysTrue()).to_table(tasks=[task])
        others = rows.filter(unmatched(rows, keys, key_columns))
        if others.num_rows == rows.num_rows:
            continue
        removed.append(task.file)
        if others.num_rows:
            added.extend(_dataframe_to_data_files(meta, others, table.io, write_uuid, counter))
    return removed, added


def candidates(keys: Any, key_columns: Sequence[str]) -> Any:
    """A filter every row with one of ``keys`` passes (with several columns, a few more)."""
    from pyiceberg.expressions import And, In, Reference

    each = [In(term=Reference(c), values=set(keys.column(c).to_pylist())) for c in key_columns]
    return each[0] if len(each) == 1 else And(*each)


def unmatched(rows: Any, keys: Any, key_columns: Sequence[str]) -> Any:
    """A mask of the ``rows`` whose key columns equal none of ``keys`` (a null key: none)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    names = list(key_columns)
    keys = keys.cast(pa.schema([rows.schema.field(c) for c in names]))
    place = pa.array(range(rows.num_rows), pa.int64())
    index = pa.table([*(rows.column(c) for c in names), place], names=[*names, "_onceflow_row"])
    hit = index.join(keys, keys=names, join_type="left semi").column("_onceflow_row")
    return pc.invert(pc.is_in(place, value_set=hit.combine_chunks()))
