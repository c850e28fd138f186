"""Apache Iceberg tables, exactly once: each delivery one snapshot that names it.

In an exactly-once streaming run each delivery (see
:class:`~onceflow.connectors.base.TransactionalWriter`) writes its data files first (``prepare``:
durable, referenced by no snapshot, so invisible), then appends them in one snapshot whose
summary carries the delivery's marker (``onceflow.delivery``, with ``onceflow.pipeline``).
Whether a delivery happened is a question the table answers: a snapshot names it.

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
import re
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
from onceflow.connectors.iceberg_rows import ID_COLUMN, convert, fault, inferred
from onceflow.connectors.iceberg_snapshots import (
    DELIVERY,
    VOID,
    append_once,
    delivered_marks,
    ensure_base,
    head,
)
from onceflow.kernel.records import Record

_SECRET = re.compile(r"(://[^:/@\s]+:)[^@\s]+@")
_CATALOGS: dict[str, Any] = {}  # one per process and configuration (opening one costs queries)


class IcebergSink(SinkConnector):
    """Appends elements as rows of an Iceberg table (see the module docstring).

    ``table`` is the identifier (``"namespace.name"``); ``catalog`` the pyiceberg catalog's
    properties (``{"type": "sql", "uri": ..., "warehouse": ...}``, REST, Glue ...), loaded
    under ``catalog_name``. A missing table is created (``create=True``) with ``schema`` (a
    ``pyarrow.Schema``) or else the types of the first delivery's rows, partitioned by the
    columns of ``partition_by`` (identity). An element that is a dict (or a dataclass) is a
    row; any other element is ``{"value": element}``; on a keyed stream a row also has the
    ``key``. ``with_ids`` writes the record's ID (hex) in ``_onceflow_id`` when the table has
    that column (a table the sink creates does). A row the table's schema cannot take becomes
    a dead letter with the reason.
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
    ) -> None:
        if "." not in table:
            msg = f"IcebergSink table must be 'namespace.name', got {table!r}"
            raise ConnectorError(msg)
        self.table = table
        self.catalog = dict(catalog or {})
        self.catalog_name = catalog_name
        self.schema = schema
        self.partition_by = tuple(partition_by)
        self.create = create
        self.with_ids = with_ids

    def describe(self) -> str:
        """One line for plans (never the catalog's properties)."""
        return f"iceberg {self.table} (catalog {self.catalog_name})"

    def load_catalog(self) -> Any:
        """The pyiceberg catalog (one per process and configuration)."""
        try:
            from pyiceberg.catalog import load_catalog
        except ImportError as exc:
            msg = "IcebergSink needs pyiceberg: pip install 'onceflow[iceberg]'"
            raise ConnectorError(msg) from exc
        key = json.dumps([self.catalog_name, sorted(self.catalog.items())])
        if key not in _CATALOGS:
            try:
                _CATALOGS[key] = load_catalog(self.catalog_name, **self.catalog)
            except Exception as exc:  # noqa: BLE001 - any catalog's errors, said in one line
                msg = (
                    f"cannot open the Iceberg catalog of {self.describe()}: {self.secret_free(exc)}"
                )
                raise ConnectorError(msg) from None
        return _CATALOGS[key]

    def secret_free(self, exc: BaseException) -> str:
        """An error's first line without the catalog's property values or URL passwords."""
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        for value in self.catalog.values():
            if len(value) >= 4:
                text = text.replace(value, "***")
        return _SECRET.sub(r"\1***@", text)

    def load_table(self, rows: Any = None) -> Any:
        """The table; created if missing (from ``schema``, else ``rows``' Arrow schema)."""
        from pyiceberg.exceptions import (
            CommitFailedException,
            NoSuchTableError,
            TableAlreadyExistsError,
        )

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
        try:
            _ensure_namespace(catalog, self.table.rsplit(".", 1)[0])
            tx = catalog.create_table_transaction(self.table, schema=schema)
            if self.partition_by:
                with tx.update_spec() as spec:
                    for column in self.partition_by:
                        spec.add_identity(column)
            tx.commit_transaction()
        except (TableAlreadyExistsError, CommitFailedException):
            pass  # another writer created it first: its schema it is
        return catalog.load_table(self.table)

    def prepare(self, pipeline: str, streaming: bool) -> None:
        """Check the catalog; create the table now if its schema is known; give it a snapshot."""
        table = self.load_table()
        if table is not None:
            ensure_base(table)

    def open(self, task: TaskInfo) -> SinkWriter:
        """A writer for one task."""
        return IcebergWriter(self, task)


def _ensure_namespace(catalog: Any, namespace: str) -> None:
    """Create the namespace unless it exists; two tasks may race to create it.

    A SQL catalog's loser fails on the unique key (``IntegrityError``, not pyiceberg's
    ``NamespaceAlreadyExistsError``): the namespace is there, which is all that was asked.
    """
    try:
        catalog.create_namespace_if_not_exists(namespace)
    except Exception:
        if not catalog.namespace_exists(namespace):
            raise


class IcebergWriter(TransactionalWriter):
    """One task's deliveries, each one snapshot naming it (see the module docstring)."""

    keeps_marks = True

    def __init__(self, sink: IcebergSink, task: TaskInfo) -> None:
        self.sink = sink
        self.task = task
        self.token = uuid.uuid4().hex[:12]
        self.batches: list[Any] = []  # Arrow tables of the table's schema, one per write
        self.files: list[Any] = []  # the prepared delivery's data files (pyiceberg DataFile)
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
                ensure_base(self._table)
        return self._table

    # -- rows ----------------------------------------------------------------------------

    def write(self, records: Sequence[Record]) -> list[Rejected]:
        """Turn records into rows; rows the table's schema cannot take are refused.

        The records are checked together (one Arrow table); only if that fails is each tried
        alone, to find the ones at fault.
        """
        rows = [(rec, self._row(rec)) for rec in records]
        if not rows:
            return []
        table = self.table([row for _rec, row in rows])
        if table is None:
            why = f"cannot be a row of {self.sink.table}: no row to make the new table's types of"
            return [(rec, why) for rec, _row in rows]
        schema = table.schema().as_arrow()
        if self.sink.with_ids and ID_COLUMN in schema.names:
            for rec, row in rows:
                if rec.id:
                    row[ID_COLUMN] = rec.id.hex()
        arrow = convert([row for _rec, row in rows], schema)
        if arrow is not None:
            self.batches.append(arrow)
            return []
        rejected: list[Rejected] = []
        good: list[dict[str, Any]] = []
        for rec, row in rows:
            reason = fault(row, schema)
            if reason is None:
                good.append(row)
            else:
                rejected.append((rec, f"cannot be a row of {self.sink.table}: {reason}"))
        together = convert(good, schema) if good else None
        if good and together is None:  # each fits alone, not together: not a row's fault
            msg = f"{self.sink.describe()}: rows that fit the table alone do not fit it together"
            raise ConnectorError(msg)
        if together is not None:
            self.batches.append(together)
        return rejected

    def _row(self, rec: Record) -> dict[str, Any]:
        elem = rec.elem
        key: Any = None
        if self.task.keyed:
            key, elem = elem
        row = element_row(elem)
        if row is None:
            row = {"value": elem}
        if self.task.keyed and "key" not in row:
            row = {"key": key, **row}
        return row

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
        if not self.batches:  # every record refused: nothing to commit, nothing to look for
            self.marker = {"delivery": delivery, "empty": True}
            return json.dumps(self.marker)
        import pyarrow as pa

        table = self.table()
        arrow = pa.concat_tables(self.batches)
        self.batches = []
        self.files = list(_dataframe_to_data_files(table.metadata, arrow, table.io))
        self.marker = {"delivery": delivery, "base": head(table)}
        return json.dumps(self.marker)

    def commit(self) -> None:
        """Append the data files in one snapshot that names the delivery (if none does yet).

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
        self.prepared = False
        return happened

    def abort(self) -> None:
        """Drop the rows; data files no commit was tried with are deleted (else orphans)."""
        self.batches = []
        if self.files and not self.committing and self._table is not None:
            for data_file in self.files:
                try:
                    self._table.io.delete(data_file.file_path)
                except Exception:  # noqa: BLE001, S110 - an orphan file is invisible; GC takes it
                    pass
        self.files = []

    def aborted_cleanly(self) -> bool:
        """Nothing was prepared: no marker was handed out, nothing can appear."""
        return not self.prepared

    # -- without transactions (bounded and at-least-once runs) ---------------------------

    def flush(self) -> list[Rejected]:
        """Append what is buffered in one snapshot of its own."""
        if self.batches:
            self.prepare()
            self.commit()
        return []

    def close(self) -> None:
        """The task succeeded."""
        self.flush()

    def _append(self, delivery: str, files: list[Any], void: bool) -> str:
        """:func:`append_once` on the table; a commit of unknown outcome breaks the transaction."""
        from pyiceberg.exceptions import CommitStateUnknownException

        try:
            return append_once(
                self.table(), delivery, self.task.pipeline, files, void, self.sink.describe()
            )
        except (CommitStateUnknownException, OSError) as exc:
            raise TransactionBroken(self.sink.secret_free(exc)) from exc
