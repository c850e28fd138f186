"""Parquet files, exactly once (see :mod:`onceflow.connectors.staged` for the transaction).

In an exactly-once streaming run each delivery's files are staged and renamed into place
when it commits; a kill at any point leaves every record visible once. Rows go to Hive-style
folders (``user=u1/``) by ``partition_by``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from onceflow.connectors.base import Rejected, SinkConnector, SinkWriter, TaskInfo, element_row
from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.local_files import is_shared
from onceflow.connectors.staged import STAGING, StagedFilesWriter, compaction_lock, local_folder
from onceflow.kernel.records import Record

ID_COLUMN = "_onceflow_id"
__all__ = ["ID_COLUMN", "STAGING", "ParquetSink", "ParquetWriter"]


class ParquetSink(SinkConnector):
    """Writes elements as rows of Parquet files under ``path`` (see the module docstring).

    An element that is a dict (or a dataclass) is a row; any other element is the row
    ``{"value": element}``; on a keyed stream a row also has the ``key``. ``partition_by``
    names columns whose values become folders (``user=u1/``); ``row_group_size`` caps the
    rows per row group; ``schema`` (a ``pyarrow.Schema``) fixes the columns' types, else each
    file's types are inferred from its rows (a row that does not fit the others becomes a
    dead letter; a column all None so far is written as text). A field ``schema`` does not
    name makes its row a dead letter (the key of a keyed stream is written only if it names
    ``key``). ``with_ids`` adds the record's ID as the
    ``_onceflow_id`` column (hex), to ``schema`` too.
    """

    def __init__(
        self,
        path: str,
        *,
        partition_by: Sequence[str] = (),
        row_group_size: int | None = None,
        schema: Any = None,
        with_ids: bool = True,
        compression: str = "snappy",
        shared: bool = False,
    ) -> None:
        if row_group_size is not None and row_group_size < 1:
            msg = f"ParquetSink row_group_size must be at least 1, got {row_group_size}"
            raise ConnectorError(msg)
        self.path = local_folder(path, "ParquetSink")
        self.partition_by = tuple(partition_by)
        self.row_group_size = row_group_size
        self.schema = schema
        self.with_ids = with_ids
        self.written_schema = _with_id_column(schema, with_ids)
        self.known_columns = set(schema.names) if schema is not None else set()
        if with_ids:
            self.known_columns.add(ID_COLUMN)
        self.compression = compression
        self.shared = shared

    def describe(self) -> str:
        """One line for plans."""
        by = f" by {','.join(self.partition_by)}" if self.partition_by else ""
        return f"parquet {self.path}{by}"

    def prepare(self, pipeline: str, streaming: bool) -> None:
        """Create the folders; a bounded run first removes the files an earlier one wrote."""
        os.makedirs(os.path.join(self.path, STAGING), exist_ok=True)
        if not streaming:
            with compaction_lock(self.path):  # not under a compaction's feet
                for folder, _dirs, files in os.walk(self.path):
                    for name in files:
                        if name.startswith(("part-", "compacted-")) and name.endswith(".parquet"):
                            os.unlink(os.path.join(folder, name))

    def local_paths(self) -> list[str]:
        """The folder the workers write, unless it is on shared storage."""
        return [] if self.shared or is_shared(self.path) else [self.path]

    def staging_folder(self) -> str | None:
        """The sink's staging folder (see :mod:`onceflow.connectors.staged`)."""
        return os.path.join(self.path, STAGING)

    def open(self, task: TaskInfo) -> SinkWriter:
        """A writer for one task."""
        return ParquetWriter(self, task)


class ParquetWriter(StagedFilesWriter):
    """One task's deliveries as Parquet files."""

    suffix = ".parquet"
    refusal = "cannot be a Parquet row"

    def __init__(self, sink: ParquetSink, task: TaskInfo) -> None:
        super().__init__(sink.path, task)
        self.sink = sink
        self.columns: Any = None  # the pyarrow schema inferred so far (no schema given)

    def write(self, records: Sequence[Record]) -> list[Rejected]:
        """Turn records into rows, checked against the columns as one table.

        Only when the table cannot be built (a row's types clash with the others, or with
        ``schema``) are the rows checked one by one, so that the culprit is refused alone
        instead of failing the file; the common case costs one conversion per chunk.
        """
        rows: list[tuple[int, Record, dict[str, Any]]] = []
        rejected: list[tuple[int, Rejected]] = []
        for i, rec in enumerate(records):
            try:
                rows.append((i, rec, self.row(rec)))
            except (TypeError, ValueError) as exc:
                rejected.append((i, (rec, f"{self.refusal}: {exc}")))
        try:
            self._fit([row for _i, _rec, row in rows])
        except (TypeError, ValueError, ArithmeticError):  # pyarrow's errors are these too
            kept = []
            for i, rec, row in rows:
                try:
                    self._fit([row])
                    kept.append((i, rec, row))
                except (TypeError, ValueError, ArithmeticError) as exc:
                    rejected.append((i, (rec, f"{self.refusal}: {exc}")))
            rows = kept
        self.rows.extend((rec.id, row) for _i, rec, row in rows)
        return [refusal for _i, refusal in sorted(rejected, key=lambda r: r[0])]

    def row(self, rec: Record) -> dict[str, Any]:
        """The record as a row (not yet checked against the columns)."""
        elem = rec.elem
        key: Any = None
        if self.task.keyed:
            key, elem = elem
        row = element_row(elem)
        if row is None:
            row = {"value": elem}
        if self.task.keyed and (self.sink.schema is None or "key" in self.sink.known_columns):
            row = {"key": key, **row}
        for column in self.sink.partition_by:
            if column not in row:
                msg = f"no column {column!r} to partition by"
                raise ValueError(msg)
        if self.sink.with_ids and rec.id:
            row[ID_COLUMN] = rec.id.hex()
        return row

    def _fit(self, rows: list[dict[str, Any]]) -> None:
        """Check rows against the sink's schema, or widen this writer's inferred columns."""
        import pyarrow as pa

        if not rows:
            return
        if self.sink.schema is not None:
            known = self.sink.known_columns
            unknown = dict.fromkeys(n for row in rows for n in row if n not in known)
            if unknown:  # from_pylist would drop them silently
                msg = f"no column(s) {', '.join(map(repr, unknown))} in the sink's schema"
                raise ValueError(msg)
            pa.Table.from_pylist(rows, schema=self.sink.written_schema)
            return
        # every row's fields: from_pylist alone takes the first row's and drops the others'
        names = dict.fromkeys(name for row in rows for name in row)
        found = pa.Table.from_pydict({n: [row.get(n) for row in rows] for n in names}).schema
        if self.columns is None:
            self.columns = found
        else:
            self.columns = pa.unify_schemas([self.columns, found], promote_options="permissive")

    def folder(self, row: dict[str, Any]) -> str:
        """``col=value/...`` of a row (values quoted as Hive-style partition folders)."""
        parts = [f"{c}={quote(str(row.pop(c)), safe='')}" for c in self.sink.partition_by]
        return os.path.join(*parts) if parts else ""

    def write_file(self, file: Any, rows: list[Any]) -> None:
        """One Parquet file of the rows (the partition columns are its folders)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = self.sink.written_schema if self.sink.schema is not None else self.columns
        if schema is not None and self.sink.schema is None:
            # a column all None so far is text, never type null: a reader taking this file's
            # schema for the folder's could not read the others' values into null
            schema = pa.schema(
                [pa.field(f.name, pa.string()) if pa.types.is_null(f.type) else f for f in schema]
            )
        if schema is not None and self.sink.partition_by:
            schema = pa.schema([f for f in schema if f.name not in self.sink.partition_by])
        table = pa.Table.from_pylist(rows, schema=schema)
        pq.write_table(
            table, file, row_group_size=self.sink.row_group_size, compression=self.sink.compression
        )


def _with_id_column(schema: Any, with_ids: bool) -> Any:
    """The user's schema with the ID column after its own (unless it names it)."""
    if schema is None or not with_ids or ID_COLUMN in schema.names:
        return schema
    import pyarrow as pa

    return schema.append(pa.field(ID_COLUMN, pa.string()))
