"""Apache Iceberg tables, exactly once: each delivery one snapshot that names it.

In an exactly-once streaming run each delivery (see
:class:`~onceflow.connectors.base.TransactionalWriter`) writes its data files first (``prepare``:
durable, referenced by no snapshot, so invisible), then appends them in one snapshot whose
summary carries the delivery's marker (``onceflow.delivery``, with ``onceflow.pipeline``).
Whether a delivery happened is a question the table answers: a snapshot names it.

With ``mode="upsert"`` a delivery's snapshot also removes the table's rows that have one of the
delivery's keys (the last row per key is then added; ``(key, None)`` only removes): copy-on-write,
its data files rewritten at commit time on the head the commit asserts (:mod:`.iceberg_upserts`).
The marker, the looking and the void are the same, so a delivery applies once.

An Iceberg commit is a compare-and-swap of the table's metadata pointer, and the sink makes
every commit assert that the branch head is the one it looked at. Before each try it looks
through the table's snapshots for its delivery; on a conflict it refreshes the table and looks
again (pyiceberg's own retry, which would rebase the snapshot without looking, is not used).

A retry of the sink partition that finds the interrupted delivery's marker in no snapshot
commits, under the same compare-and-swap, an empty snapshot that voids the marker
(``onceflow.void``): a late attempt of the delivery (paused, not dead) then finds the void before
it can commit, and gives up; or it won the race, and the retry finds its snapshot instead. So
nothing has to be fenced beforehand: :meth:`IcebergWriter.settle` does nothing.

Expiring snapshots deletes their markers. A marker remembers the snapshot the table was at when
the delivery was prepared; a retry that no longer finds that snapshot cannot tell whether the
delivery committed, and stops with an error rather than guess (see the guide: expire only
snapshots older than the longest time a pipeline may stay stopped). Data files of a delivery
that never committed are orphans no snapshot references: invisible, removed by the table's
orphan-file maintenance.

Catalog properties (``catalog=``) go to ``pyiceberg.catalog.load_catalog`` as they are and are
never printed (they may hold credentials).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from onceflow.connectors.base import (
    DeliveryMark,
    Rejected,
    SinkConnector,
    SinkWriter,
    TaskInfo,
    TransactionalWriter,
    TransactionBroken,
    element_row,
)
from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.iceberg_catalog import create_table, open_catalog, secret_free
from onceflow.connectors.iceberg_rows import ID_COLUMN, fitting, inferred
from onceflow.connectors.iceberg_snapshots import (
    DELIVERY,
    VOID,
    append_once,
    delete_files,
    delivered_marks,
    ensure_base,
    head,
)
from onceflow.connectors.iceberg_upserts import Changes, rewrites
from onceflow.connectors.keyed_rows import (
    Delete,
    check_mode,
    delete_row,
    keyed_row,
    upsert_row,
)
from onceflow.kernel.records import Record

MODES = ("append", "upsert")


class IcebergSink(SinkConnector):
    """Appends elements as rows of an Iceberg table (see the module docstring).

    ``table`` is the identifier (``"namespace.name"``); ``catalog`` the pyiceberg catalog's
    properties (``{"type": "sql", "uri": ..., "warehouse": ...}``, REST, Glue ...), loaded
    under ``catalog_name``. A missing table is created (``create=True``) with ``schema`` (a
    ``pyarrow.Schema``) or else the types of the first delivery's rows, partitioned by the
    columns of ``partition_by`` (identity). An element that is a dict (or a dataclass) is a
    row; any other element is ``{"value": element}``; on a keyed stream a row also has the
    ``key`` (or, with ``key_columns``, the key fills those the row lacks). ``with_ids`` writes
    the record's ID (hex) in ``_onceflow_id`` when the table has that column (a table the sink
    creates does). A row the table's schema cannot take becomes a dead letter with the reason.
    ``mode="upsert"`` replaces the rows whose ``key_columns`` equal a row's (the last of a
    delivery's rows for a key wins) and, on a keyed stream, ``(key, None)`` deletes them.
    """

    def __init__(
        self,
        table: str,
        *,
        catalog: dict[str, str] | None = None,
        catalog_name: str = "default",
        schema: Any = None,
        partition_by: Sequence[str] = (),
        create: bool = True,
        with_ids: bool = True,
        mode: str = "append",
        key_columns: Sequence[str] = (),
    ) -> None:
        if "." not in table:
            msg = f"IcebergSink table must be 'namespace.name', got {table!r}"
            raise ConnectorError(msg)
        check_mode("IcebergSink", mode, MODES, key_columns)
        self.mode = mode  # one of MODES
        self.key_columns = tuple(key_columns)
        self.table = table
        self.catalog = dict(catalog or {})
        self.catalog_name = catalog_name
        self.schema = schema
        self.partition_by = tuple(partition_by)
        self.create = create
        self.with_ids = with_ids

    def describe(self) -> str:
        """One line for plans (never the catalog's properties)."""
        upsert = ", upsert" if self.mode == "upsert" else ""
        return f"iceberg {self.table} (catalog {self.catalog_name}{upsert})"

    def load_catalog(self) -> Any:
        """The pyiceberg catalog (one per process and configuration)."""
        return open_catalog(self.catalog_name, self.catalog, self.describe())

    def secret_free(self, exc: BaseException) -> str:
        """An error's first line without the catalog's property values or URL passwords."""
        return secret_free(exc, self.catalog)

    def load_table(self, rows: Any = None) -> Any:
        """The table; created if missing (from ``schema``, else ``rows``' Arrow schema)."""
        from pyiceberg.exceptions import NoSuchTableError

        catalog = self.load_catalog()
        try:
            return catalog.load_table(self.table)
        except NoSuchTableError:
            schema = self.schema if self.schema is not None else inferred(rows, self.with_ids)
            if not self.create or schema is None:
                if not self.create:
                    msg = f"{self.describe()}: no such table (create it, or pass create=True)"
                    raise ConnectorError(msg) from None
                return None
        create_table(catalog, self.table, schema, self.partition_by)
        return catalog.load_table(self.table)

    def prepare(self, pipeline: str, streaming: bool) -> None:
        """Check the catalog; create the table now if its schema is known; give it a snapshot."""
        table = self.load_table()
        if table is not None:
            self.check_keys(table)
            ensure_base(table)

    def check_keys(self, table: Any) -> None:
        """Stop if the table lacks one of the ``key_columns``."""
        missing = [c for c in self.key_columns if c not in table.schema().column_names]
        if missing:
            msg = f"Iceberg table {self.table!r} has no key column(s) {', '.join(missing)}"
            raise ConnectorError(msg)

    def open(self, task: TaskInfo) -> SinkWriter:
        """A writer for one task."""
        return IcebergWriter(self, task)


class IcebergWriter(TransactionalWriter):
    """One task's deliveries, each one snapshot naming it (see the module docstring)."""

    keeps_marks = True

    def __init__(self, sink: IcebergSink, task: TaskInfo) -> None:
        self.sink = sink
        self.task = task
        self.token = uuid.uuid4().hex[:12]
        self.batches: list[Any] = []  # Arrow tables of the table's schema, one per write
        self.changes = Changes(sink.key_columns) if sink.mode == "upsert" else None
        self.files: list[Any] = []  # the prepared delivery's data files (pyiceberg DataFile)
        self.removing: Any = None  # the prepared upsert's keys (an Arrow table)
        self.marker: dict[str, Any] | None = None
        self.deliveries = 0
        self.prepared = False
        self.committing = False
        self._table: Any = None

    @property
    def identity(self) -> str:
        """The sink partition (nothing is fenced by it: see :meth:`settle`)."""
        return f"{self.task.sink}/{self.task.partition}"

    def table(self, rows: Any = None) -> Any:
        """The table, loaded (or created) once per writer."""
        if self._table is None:
            self._table = self.sink.load_table(rows)
            if self._table is not None:
                self.sink.check_keys(self._table)
                ensure_base(self._table)
        return self._table

    # -- rows ----------------------------------------------------------------------------

    def write(self, records: Sequence[Record]) -> list[Rejected]:
        """Turn records into rows; rows the table's schema cannot take are refused.

        The records are checked together (one Arrow table); only if that fails is each tried
        alone, to find the ones at fault. A delete before the table exists deletes nothing.
        """
        rows: list[tuple[Record, dict[str, Any]]] = []
        rejected: list[Rejected] = []
        for rec in records:
            try:
                rows.append((rec, self._row(rec)))
            except ValueError as exc:
                rejected.append((rec, f"cannot be a row of {self.sink.table}: {exc}"))
        upserts = [row for _rec, row in rows if not isinstance(row, Delete)]
        table = self.table(upserts) if rows else None
        if table is None:
            why = f"cannot be a row of {self.sink.table}: no row to make the new table's types of"
            return rejected + [(rec, why) for rec, row in rows if not isinstance(row, Delete)]
        schema = table.schema().as_arrow()
        if self.sink.with_ids and ID_COLUMN in schema.names:
            for rec, row in rows:
                if rec.id and not isinstance(row, Delete):
                    row[ID_COLUMN] = rec.id.hex()
        try:
            if self.changes is not None:
                faults = self.changes.put([row for _rec, row in rows], schema)
            else:
                arrow, _kept, faults = fitting([row for _rec, row in rows], schema)
                if arrow is not None:
                    self.batches.append(arrow)
        except ValueError as exc:  # rows that fit alone, not together: not a row's fault
            msg = f"{self.sink.describe()}: {exc}"
            raise ConnectorError(msg) from None
        return rejected + [
            (rows[i][0], f"cannot be a row of {self.sink.table}: {why}") for i, why in faults
        ]

    def _row(self, rec: Record) -> dict[str, Any]:
        elem = rec.elem
        key: Any = None
        keys = self.sink.key_columns
        if self.task.keyed:
            key, elem = elem
            if elem is None and self.changes is not None:
                return delete_row(key, keys)
        row = element_row(elem)
        if row is None:
            row = {"value": elem}
        if self.task.keyed:
            row = keyed_row(row, key, keys)
        return upsert_row(row, keys) if self.changes is not None else row

    # -- the transaction -----------------------------------------------------------------

    def prepare(self, mark: DeliveryMark | None = None) -> str:
        """Write the data files (referenced by no snapshot yet); the marker names the delivery.

        The delivery is ``<sink>/<partition>/<batch>/<writer>/<n>``, then ``@`` and ``mark``
        if there is one. The marker also names a snapshot the table was at (when the writer
        last looked: an ancestor of the delivery's): a retry that no longer finds that one
        knows snapshots were expired since, and that the delivery's may be among them.
        """
        from pyiceberg.io.pyarrow import _dataframe_to_data_files

        delivery = f"{self._prefix}{self.task.batch}/{self.token}/{self.deliveries}"
        if mark is not None:
            delivery += f"@{mark.text()}"
        self.deliveries += 1
        self.prepared = True
        rows, self.removing = self._taken()
        if rows is None and self.removing is None:  # every record refused: nothing to look for
            self.marker = {"delivery": delivery, "empty": True}
            return json.dumps(self.marker)
        table = self.table()
        if rows is not None:
            self.files = list(_dataframe_to_data_files(table.metadata, rows, table.io))
        self.marker = {"delivery": delivery, "base": head(table)}
        return json.dumps(self.marker)

    def _taken(self) -> tuple[Any, Any]:
        """The delivery's rows to add and keys to remove (None: none); the writer forgets them."""
        if self.changes is not None:
            return self.changes.take()
        import pyarrow as pa

        rows = pa.concat_tables(self.batches) if self.batches else None
        self.batches = []
        return rows, None

    def commit(self) -> None:
        """Add the data files in one snapshot that names the delivery (if none does yet).

        An upsert's snapshot also replaces the table's data files that hold the delivery's
        keys by files of their other rows (found at each try, on the head it asserts).

        A delivery a retry declared void was taken over by that retry: this attempt is a late
        one, and its transaction is broken (see :class:`TransactionBroken`).
        """
        assert self.marker is not None, "commit() without prepare()"
        if self.marker.get("empty"):
            self.prepared = False
            return
        self.committing = True
        outcome = self._append(self.marker["delivery"], self.files, void=False)
        self.committing = False
        if outcome == VOID:
            msg = f"delivery {self.marker['delivery']} was voided by a retry"
            raise TransactionBroken(msg)
        self.files = []
        self.removing = None
        self.prepared = False

    def settle(self, identities: Sequence[str]) -> None:
        """Nothing to end: :meth:`committed` voids a marker it does not find.

        The void and a late attempt's commit are two compare-and-swaps of one metadata
        pointer, each made only after looking for the other: whichever comes second sees the
        first, so once :meth:`committed` answers, the answer stays true.
        """

    def committed(self, marker: str) -> bool:
        """Whether a snapshot names the delivery; if none does, it is voided (never will)."""
        found = json.loads(marker)
        if found.get("empty"):
            return True  # it had nothing to make visible
        table = self.table()
        table.refresh()
        if found["base"] is not None and table.metadata.snapshot_by_id(found["base"]) is None:
            msg = (
                f"{self.sink.describe()}: cannot tell whether delivery {found['delivery']} "
                f"committed: snapshot {found['base']}, current when it was prepared, has been "
                "expired since (and the delivery's may have been too); keep snapshots at least "
                "as long as a pipeline may stay stopped (see the Iceberg sink's guide)"
            )
            raise ConnectorError(msg)
        return self._append(found["delivery"], [], void=True) == DELIVERY

    @property
    def _prefix(self) -> str:
        """What every delivery of this sink partition begins with."""
        return f"{self.task.sink}/{self.task.partition}/"

    def delivered_in(
        self, batch: int, incarnation: str, since: str | None
    ) -> list[DeliveryMark] | None:
        """The marks of the partition's deliveries of ``batch`` that a snapshot appended."""
        table = self.table()
        if table is None:
            return []
        table.refresh()
        return delivered_marks(table.metadata, f"{self._prefix}{batch}/", batch, incarnation)

    def recover(self) -> bool:
        """After a broken commit: whether a snapshot names the delivery (voided if not)."""
        self.committing = False
        if self.marker is None:
            return False
        happened = self.committed(json.dumps(self.marker))
        self.files = []
        self.removing = None
        self.prepared = False
        return happened

    def abort(self) -> None:
        """Drop the rows; data files no commit was tried with are deleted (else orphans)."""
        self.batches = []
        if self.changes is not None:
            self.changes.clear()
        if self.files and not self.committing and self._table is not None:
            delete_files(self._table, self.files)
        self.files = []
        self.removing = None

    def aborted_cleanly(self) -> bool:
        """Nothing was prepared: no marker was handed out, nothing can appear."""
        return not self.prepared

    # -- without transactions (bounded and at-least-once runs) ---------------------------

    def flush(self) -> list[Rejected]:
        """Commit what is buffered in one snapshot of its own."""
        if self.batches or (self.changes is not None and self.changes.last):
            self.prepare()
            self.commit()
        return []

    def close(self) -> None:
        """The task succeeded."""
        self.flush()

    def _append(self, delivery: str, files: list[Any], void: bool) -> str:
        """:func:`append_once` on the table; a commit of unknown outcome breaks the transaction."""
        from pyiceberg.exceptions import CommitStateUnknownException

        keys, columns = self.removing, self.sink.key_columns
        rewrite = None if void or keys is None else (lambda head: rewrites(head, keys, columns))
        try:
            return append_once(
                self.table(),
                delivery,
                self.task.pipeline,
                files,
                void,
                self.sink.describe(),
                rewrite,
            )
        except (CommitStateUnknownException, OSError) as exc:
            raise TransactionBroken(self.sink.secret_free(exc)) from exc
