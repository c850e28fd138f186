"""Files made visible exactly once: a delivery staged, then renamed into place.

The transaction of the file sinks (Parquet, JSON lines) in exactly-once streaming runs (see
:class:`~onceflow.connectors.base.TransactionalWriter`): a delivery is a set of files (one per
folder its rows go to) written and fsynced under a hidden staging folder
(``<sink folder>/_onceflow_staging``; readers skip names that start with ``_``), and its
commit renames them into place. A file's name is made of its micro-batch, partition and a
digest of the record IDs it holds, so a delivery written again holds the same records under
the same names.

Recovery, after a kill at any point: the next attempt of the sink partition first deletes the
staging files of every earlier attempt (a rename that has not happened by then never can: a
zombie's rename of a deleted file fails), then asks whether the interrupted delivery's files
are all in place. If they are, it committed; if only some are (a kill between two renames),
those are deleted and the records written again. A reader listing the folder in that moment
can see part of a delivery that the retry then replaces; with one file per delivery there is
no such moment.

The commit needs an atomic rename: local folders and shared POSIX mounts (NFS), not object
stores.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import json
import os
import uuid
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from onceflow.connectors.base import DeliveryMark, Rejected, TaskInfo, TransactionalWriter
from onceflow.connectors.errors import ConnectorError
from onceflow.kernel.records import Record

STAGING = "_onceflow_staging"

Row = tuple[bytes, Any]  # (record ID, what the file holds for the record)


def local_folder(path: str, sink: str) -> str:
    """``path`` as an absolute local path; object stores are refused (no atomic rename)."""
    if "://" in path and not path.startswith("file://"):
        msg = (
            f"{sink}({path!r}): only local folders and shared POSIX mounts are supported "
            "(the commit renames files, which object stores cannot do atomically); on an "
            "object store (s3a://, gs://, abfs://) write an Iceberg table (sinks.Iceberg), "
            "whose commit is one atomic catalog update"
        )
        raise ConnectorError(msg)
    return os.path.abspath(path.removeprefix("file://"))


class StagedFilesWriter(TransactionalWriter):
    """One task's deliveries to a folder: staged files, renamed into place at commit.

    A subclass says how a record becomes a row (:meth:`row`, raising TypeError or
    ValueError for one that cannot), which folder a row goes to (:meth:`folder`) and how
    rows become a file (:meth:`write_file`).
    """

    suffix = ".dat"
    refusal = "cannot be written"  # how a refused record's reason begins

    def __init__(self, root: str, task: TaskInfo) -> None:
        self.root = root
        self.task = task
        self.token = uuid.uuid4().hex[:12]  # this writer's staging files start with it
        self.rows: list[Row] = []
        self.staged: list[tuple[str, str]] = []  # (staging file, final file)
        self.deliveries = 0
        self.prepared = False

    @abc.abstractmethod
    def row(self, rec: Record) -> Any:
        """What the file holds for ``rec``."""

    def folder(self, row: Any) -> str:
        """The folder (under the sink's) a row goes to: the sink's own by default."""
        return ""

    @abc.abstractmethod
    def write_file(self, file: Any, rows: list[Any]) -> None:
        """Write ``rows`` to an open binary file."""

    # -- the transaction -----------------------------------------------------------------

    @property
    def identity(self) -> str:
        """One per sink partition: its staging folder."""
        return f"{self.task.sink}/{self.task.partition}"

    def write(self, records: Sequence[Record]) -> list[Rejected]:
        """Turn records into rows; a record that cannot be one is refused with the reason."""
        rejected: list[Rejected] = []
        for rec in records:
            try:
                self.rows.append((rec.id, self.row(rec)))
            except (TypeError, ValueError) as exc:  # pyarrow's errors are both too
                rejected.append((rec, f"{self.refusal}: {exc}"))
        return rejected

    def prepare(self, mark: DeliveryMark | None = None) -> str:
        """Write and fsync the staged files; the marker names where they will be.

        ``mark`` is not kept (:meth:`delivered_in` cannot tell): a delivery of the same
        records is written under the same names again, replacing its files.
        """
        self.staged = self._stage()
        self.prepared = True
        return json.dumps([os.path.relpath(final, self.root) for _staging, final in self.staged])

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
        finals = [os.path.join(self.root, f) for f in json.loads(marker)]
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

    def _stage(self) -> list[tuple[str, str]]:
        """One staged file per folder, fsynced; (staging, final) pairs."""
        groups: dict[str, list[Row]] = {}
        for rid, row in self.rows:
            groups.setdefault(self.folder(row), []).append((rid, row))
        self.rows = []
        staged = []
        os.makedirs(self._staging_dir(self.identity), exist_ok=True)
        for folder, rows in sorted(groups.items()):
            name = self._name(rows)
            staging = os.path.join(self._staging_dir(self.identity), f"{self.token}-{name}")
            with _create(staging) as fh:
                self.write_file(fh, [row for _rid, row in rows])
                fh.flush()
                os.fsync(fh.fileno())
            staged.append((staging, os.path.join(self.root, folder, name)))
        self.deliveries += 1
        return staged

    def _name(self, rows: list[Row]) -> str:
        """``part-<batch>-<partition>-<sink>-<digest of the IDs><suffix>``.

        The same records get the same name; records without IDs, a name of this writer's own.
        """
        digest = hashlib.blake2b(digest_size=8)
        if all(rid for rid, _row in rows):
            for rid in sorted(rid for rid, _row in rows):
                digest.update(rid)
        else:
            digest.update(f"{self.token}-{self.deliveries}".encode())
        sink = quote(self.task.sink, safe="")
        return (
            f"part-{self.task.batch:06d}-{self.task.partition:05d}-{sink}-"
            f"{digest.hexdigest()}{self.suffix}"
        )

    def _staging_dir(self, identity: str) -> str:
        return os.path.join(self.root, STAGING, quote(identity, safe=""))


def _create(path: str) -> Any:
    """Open a new staging file; its folder again if ``onceflow gc`` just removed it empty."""
    try:
        return open(path, "wb")  # noqa: SIM115 - the caller closes it
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return open(path, "wb")  # noqa: SIM115


def _fsync_dirs(folders: set[str]) -> None:
    """Make the renames durable (a directory's entries are its data)."""
    for folder in folders:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
