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

A delivery's mark (:class:`~onceflow.connectors.base.DeliveryMark`, in exactly-once streaming
runs) is an empty file renamed into ``<sink folder>/_onceflow_marks/<sink>-<partition>/`` after
the delivery's files: there, the files of the delivery are all in place. Each commit deletes
the partition's marks of other micro-batches; :meth:`StagedFilesWriter.delivered_in` lists
those of one.

The commit needs an atomic rename: local folders and shared POSIX mounts (NFS), not object
stores.
"""

from __future__ import annotations

import abc
import contextlib
import fcntl
import hashlib
import json
import os
import uuid
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import quote

from onceflow.connectors.base import DeliveryMark, Rejected, TaskInfo, TransactionalWriter
from onceflow.connectors.errors import ConnectorError
from onceflow.kernel.records import Record

STAGING = "_onceflow_staging"
MARKS = "_onceflow_marks"
COMPACTION = "_onceflow_compaction"  # `onceflow compact`'s work folder and lock

Row = tuple[bytes, Any]  # (record ID, what the file holds for the record)


@contextlib.contextmanager
def compaction_lock(root: str) -> Iterator[None]:
    """An exclusive lock on a sink folder's compaction.

    `onceflow compact` runs take turns, and a bounded run's clean-up of the folder waits for a
    compaction under way.
    """
    work = os.path.join(root, COMPACTION)
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, ".lock"), "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


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

    keeps_marks = True

    def prepare(self, mark: DeliveryMark | None = None) -> str:
        """Write and fsync the staged files (``mark``'s last); the marker names their places."""
        self.staged = self._stage()
        if mark is not None:
            self.staged.append(self._stage_mark(mark))
        self.prepared = True
        return json.dumps([os.path.relpath(final, self.root) for _staging, final in self.staged])

    def commit(self) -> None:
        """Rename the staged files into place, the mark last; forget other batches' marks."""
        for staging, final in self.staged:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            os.replace(staging, final)
        _fsync_dirs({os.path.dirname(final) for _s, final in self.staged})
        self.staged = []
        self.prepared = False
        self._forget_marks(f"{self.task.batch}")

    def delivered_in(
        self, batch: int, incarnation: str, since: str | None
    ) -> list[DeliveryMark] | None:
        """The marks of the partition's committed deliveries of ``batch`` (their files)."""
        folder = self._marks_dir()
        names = os.listdir(folder) if os.path.isdir(folder) else []
        marks = [_mark_of(name) for name in names]
        found = [
            m for m in marks if m is not None and (m.batch, m.incarnation) == (batch, incarnation)
        ]
        return sorted(found, key=lambda m: m.seq)

    def _marks_dir(self) -> str:
        return os.path.join(
            self.root, MARKS, f"{quote(self.task.sink, safe='')}-{self.task.partition}"
        )

    def _stage_mark(self, mark: DeliveryMark) -> tuple[str, str]:
        """An empty file named after ``mark``, fsynced: (staging, final)."""
        name = ".".join([mark.incarnation, str(mark.batch), str(mark.seq), mark.digest or "-"])
        staging = os.path.join(self._staging_dir(self.identity), f"{self.token}-mark-{name}")
        with _create(staging) as fh:
            os.fsync(fh.fileno())
        return staging, os.path.join(self._marks_dir(), name)

    def _forget_marks(self, batch: str) -> None:
        """Delete the partition's marks of other micro-batches (none is asked about again)."""
        folder = self._marks_dir()
        for name in os.listdir(folder) if os.path.isdir(folder) else []:
            if name.split(".")[1:2] != [batch]:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(folder, name))

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


def _mark_of(name: str) -> DeliveryMark | None:
    """The mark a mark file's name holds (``incarnation.batch.seq.digest``), if it is one."""
    parts = name.split(".")
    if len(parts) != 4 or not parts[1].isdigit() or not parts[2].isdigit():  # noqa: PLR2004
        return None
    return DeliveryMark(parts[0], int(parts[1]), int(parts[2]), "" if parts[3] == "-" else parts[3])
