"""Parquet files, exactly once: each delivery staged, then made visible by a rename.

A streaming exactly-once run delivers a task's records to the sink in transactions (see
:class:`~onceflow.connectors.base.TransactionalWriter`); here a transaction is a set of
Parquet files (one per ``partition_by`` value) written and fsynced under a hidden staging
folder (``_onceflow_staging``, which Parquet readers skip), and its commit renames them into
place. A file's name is made of its micro-batch, partition and a digest of the record IDs it
holds, so a delivery written again holds the same records under the same names.

Recovery, after a kill at any point: the next attempt of the sink partition first deletes the
staging files of every earlier attempt (a rename that has not happened by then never can: a
zombie's rename of a deleted file fails), then asks whether the interrupted delivery's files
are all in place. If they are, it committed; if only some are (a kill between two renames),
those are deleted and the records written again. A reader listing the folder in that moment
can see part of a delivery that the retry then replaces; with one file per delivery (no
``partition_by``) there is no such moment.

Local folders and shared POSIX mounts (NFS) are supported: the commit needs an atomic rename,
which object stores (``s3a://``) do not have.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import uuid
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from onceflow.connectors.base import (
    Rejected,
    SinkConnector,
    SinkWriter,
    TaskInfo,
    TransactionalWriter,
)
from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.files import is_shared
from onceflow.kernel.records import Record

STAGING = "_onceflow_staging"  # Parquet readers skip names that start with "_" or "."
ID_COLUMN = "_onceflow_id"


class ParquetSink(SinkConnector):
    """Writes elements as rows of Parquet files under ``path`` (see the module docstring).

    An element that is a dict (or a dataclass) is a row; any other element is the row
    ``{"value": element}``; on a keyed stream a row also has the ``key``. ``partition_by``
    names columns whose values become folders (``user=u1/``); ``row_group_size`` caps the
    rows per row group; ``schema`` (a ``pyarrow.Schema``) fixes the columns' types, else each
    file's types are inferred from its rows (a row that does not fit the others becomes a
    dead letter). ``with_ids`` adds the record's ID as the ``_onceflow_id`` column (hex).
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
        if "://" in path and not path.startswith("file://"):
            msg = (
                f"ParquetSink({path!r}): only local folders and shared POSIX mounts are "
                "supported (the commit renames files, which object stores cannot do atomically)"
            )
            raise ConnectorError(msg)
        if row_group_size is not None and row_group_size < 1:
            msg = f"ParquetSink row_group_size must be at least 1, got {row_group_size}"
            raise ConnectorError(msg)
        self.path = os.path.abspath(path.removeprefix("file://"))
        self.partition_by = tuple(partition_by)
        self.row_group_size = row_group_size
        self.schema = schema
        self.with_ids = with_ids
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
            for folder, _dirs, files in os.walk(self.path):
                for name in files:
                    if name.startswith("part-") and name.endswith(".parquet"):
                        os.unlink(os.path.join(folder, name))

    def local_paths(self) -> list[str]:
        """The folder the workers write, unless it is on shared storage."""
        return [] if self.shared or is_shared(self.path) else [self.path]

    def open(self, task: TaskInfo) -> SinkWriter:
        """A writer for one task."""
        return ParquetWriter(self, task)


class ParquetWriter(TransactionalWriter):
    """One task's deliveries: staged files, renamed into place at commit."""

    def __init__(self, sink: ParquetSink, task: TaskInfo) -> None:
        self.sink = sink
        self.task = task
        self.token = uuid.uuid4().hex[:12]  # this writer's staging files start with it
        self.rows: list[tuple[bytes, dict[str, Any]]] = []
        self.staged: list[tuple[str, str]] = []  # (staging file, final file)
        self.deliveries = 0
        self.prepared = False
        self.columns: Any = None  # the pyarrow schema inferred so far (no schema given)

    # -- the transaction -----------------------------------------------------------------

    @property
    def identity(self) -> str:
        """One per sink partition: its staging folder."""
        return f"{self.task.sink}/{self.task.partition}"

    def write(self, records: Sequence[Record]) -> list[Rejected]:
        """Turn records into rows; a record that cannot be a row is refused with the reason."""
        rejected: list[Rejected] = []
        for rec in records:
            try:
                row = self._row(rec)
                self._fit(row)
            except (TypeError, ValueError) as exc:  # pyarrow's errors are both too
                rejected.append((rec, f"cannot be a Parquet row: {exc}"))
                continue
            self.rows.append((rec.id, row))
        return rejected

    def _fit(self, row: dict[str, Any]) -> None:
        """Check a row against the sink's schema, or widen this writer's inferred columns.

        Rows are checked one by one, so that a row whose types clash with the others (text
        where the other rows have numbers) is refused alone instead of failing the file.
        """
        import pyarrow as pa

        if self.sink.schema is not None:
            pa.Table.from_pylist([row], schema=self.sink.schema)
            return
        one = pa.Table.from_pylist([row]).schema
        if self.columns is None:
            self.columns = one
        else:
            self.columns = pa.unify_schemas([self.columns, one], promote_options="permissive")

    def prepare(self) -> str:
        """Write and fsync the staged files; the marker names where they will be."""
        self.staged = self._stage()
        self.prepared = True
        return json.dumps([final for _staging, final in self.staged])

    def commit(self) -> None:
        """Rename the staged files into place."""
        for staging, final in self.staged:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            os.replace(staging, final)
        _fsync_dirs({os.path.dirname(final) for _s, final in self.staged})
        self.staged = []
        self.prepared = False

    def settle(self, identities: Sequence[str]) -> None:
        """Delete every earlier attempt's staged files: none of them can be renamed after."""
        for identity in identities:
            folder = self._staging_dir(identity)
            if not os.path.isdir(folder):
                continue
            for name in os.listdir(folder):
                if not name.startswith(self.token):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(folder, name))

    def committed(self, marker: str) -> bool:
        """All the delivery's files are in place; a part of them is deleted (written again)."""
        finals = [os.path.join(self.sink.path, f) for f in json.loads(marker)]
        present = [f for f in finals if os.path.exists(f)]
        if len(present) == len(finals):
            return True
        for f in present:  # cut between two renames: the retry writes them all again
            os.unlink(f)
        return False

    def abort(self) -> None:
        """Drop the rows and the staged files."""
        self.rows = []
        for staging, _final in self.staged:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staging)
        self.staged = []

    def aborted_cleanly(self) -> bool:
        """Nothing staged was ever named in a pending delivery: nothing can become visible."""
        return not self.prepared

    # -- without transactions (bounded and at-least-once runs) ---------------------------

    def flush(self) -> list[Rejected]:
        """Write what is buffered and make it visible at once."""
        if self.rows:
            self.prepare()
            self.commit()
        return []

    def close(self) -> None:
        """The task succeeded."""
        self.flush()

    # -- files ---------------------------------------------------------------------------

    def _row(self, rec: Record) -> dict[str, Any]:
        elem = rec.elem
        key: Any = None
        if self.task.keyed:
            key, elem = elem
        if dataclasses.is_dataclass(elem) and not isinstance(elem, type):
            row = dataclasses.asdict(elem)
        elif isinstance(elem, dict):
            row = dict(elem)
        else:
            row = {"value": elem}
        if self.task.keyed:
            row = {"key": key, **row}
        for column in self.sink.partition_by:
            if column not in row:
                msg = f"no column {column!r} to partition by"
                raise ValueError(msg)
        if self.sink.with_ids and rec.id:
            row[ID_COLUMN] = rec.id.hex()
        return row

    def _stage(self) -> list[tuple[str, str]]:
        """One staged file per partition folder, fsynced; (staging, final) pairs."""
        groups: dict[str, list[tuple[bytes, dict[str, Any]]]] = {}
        for rid, row in self.rows:
            groups.setdefault(self._folder(row), []).append((rid, row))
        self.rows = []
        staged = []
        os.makedirs(self._staging_dir(self.identity), exist_ok=True)
        for folder, rows in sorted(groups.items()):
            name = self._name(rows)
            staging = os.path.join(self._staging_dir(self.identity), f"{self.token}-{name}")
            self._write_file(staging, [row for _rid, row in rows])
            staged.append((staging, os.path.join(self.sink.path, folder, name)))
        self.deliveries += 1
        return staged

    def _folder(self, row: dict[str, Any]) -> str:
        """``col=value/...`` of a row (values quoted as Hive-style partition folders)."""
        parts = [f"{c}={quote(str(row.pop(c)), safe='')}" for c in self.sink.partition_by]
        return os.path.join(*parts) if parts else ""

    def _name(self, rows: list[tuple[bytes, dict[str, Any]]]) -> str:
        """``part-<batch>-<partition>-<digest of the IDs>.parquet``.

        The same records get the same name; records without IDs, a name of this writer's own.
        """
        digest = hashlib.blake2b(digest_size=8)
        if all(rid for rid, _row in rows):
            for rid in sorted(rid for rid, _row in rows):
                digest.update(rid)
        else:
            digest.update(f"{self.token}-{self.deliveries}".encode())
        return f"part-{self.task.batch:06d}-{self.task.partition:05d}-{digest.hexdigest()}.parquet"

    def _write_file(self, path: str, rows: list[dict[str, Any]]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = self.sink.schema if self.sink.schema is not None else self.columns
        if schema is not None and self.sink.partition_by:  # those columns are the folders
            keep = [f for f in schema if f.name not in self.sink.partition_by]
            schema = pa.schema(keep)
        table = pa.Table.from_pylist(rows, schema=schema)
        with open(path, "wb") as fh:
            pq.write_table(
                table,
                fh,
                row_group_size=self.sink.row_group_size,
                compression=self.sink.compression,
            )
            fh.flush()
            os.fsync(fh.fileno())

    def _staging_dir(self, identity: str) -> str:
        return os.path.join(self.sink.path, STAGING, quote(identity, safe=""))


def _fsync_dirs(folders: set[str]) -> None:
    """Make the renames durable (a directory's entries are its data)."""
    for folder in folders:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
