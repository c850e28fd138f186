"""A streaming query's checkpoint, read and written through Hadoop's FileSystem API.

Spark keeps a query's progress in its checkpoint folder (``offsets/<batch>``,
``commits/<batch>``). Onceflow reads it (the last committed batch, the offsets it ended at)
and keeps one file of its own there, ``onceflow-identity``: the identity shared with the
pipeline's Redis namespace (see :func:`~.pinning.pin_checkpoint`). Going
through the JVM's FileSystem API means the same code works for a local folder, HDFS or an
object store, whatever URL the checkpoint has.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

IDENTITY_FILE = "onceflow-identity"
# Spark's checkpoint file manager setting, and the one Onceflow picks for a local folder.
MANAGER_CONF = "spark.sql.streaming.checkpointFileManagerClass"
LOCAL_MANAGER = (
    "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager"
)
_SPARK_HEADER_LINES = 2  # a Spark offset file: version, batch metadata, then one line per source


class Checkpoint:
    """One query's checkpoint folder."""

    def __init__(self, session: SparkSession, location: str) -> None:
        self.location = location
        jvm: Any = session._jvm  # noqa: SLF001 - py4j is how PySpark reaches Hadoop
        self._jvm = jvm
        self._root = jvm.org.apache.hadoop.fs.Path(location)
        self._fs = self._root.getFileSystem(session._jsc.hadoopConfiguration())  # noqa: SLF001

    @property
    def local(self) -> bool:
        """Whether the checkpoint is on this machine's file system (``file:``)."""
        return str(self._fs.getScheme()) == "file"

    def _path(self, *parts: str) -> Any:
        path = self._root
        for part in parts:
            path = self._jvm.org.apache.hadoop.fs.Path(path, part)
        return path

    def exists(self, *parts: str) -> bool:
        """Whether the checkpoint (or a file in it) exists."""
        return bool(self._fs.exists(self._path(*parts)))

    def read(self, *parts: str) -> str | None:
        """A file's text, None when it does not exist."""
        path = self._path(*parts)
        if not self._fs.exists(path):
            return None
        stream = self._fs.open(path)
        try:
            return str(self._jvm.org.apache.commons.io.IOUtils.toString(stream, "UTF-8"))
        finally:
            stream.close()

    def write(self, text: str, *parts: str) -> None:
        """Write a file (replacing it)."""
        stream = self._fs.create(self._path(*parts), True)
        try:
            stream.write(bytearray(text.encode()))
        finally:
            stream.close()

    def batches(self, folder: str) -> list[int]:
        """Batch numbers in ``offsets`` or ``commits``."""
        path = self._path(folder)
        if not self._fs.exists(path):
            return []
        names = [status.getPath().getName() for status in self._fs.listStatus(path)]
        return sorted(int(n) for n in names if str(n).isdigit())

    def last_committed(self) -> int | None:
        """The newest micro-batch in the commit log."""
        found = self.batches("commits")
        return found[-1] if found else None

    def has_progress(self) -> bool:
        """Whether a query ever planned a batch here."""
        return bool(self.batches("offsets"))

    def end_offsets(self, batch: int) -> list[Any]:
        """Each source's offsets at the end of ``batch`` (JSON values, in source order)."""
        text = self.read("offsets", str(batch))
        if text is None:
            return []
        found: list[Any] = []
        for line in text.splitlines()[_SPARK_HEADER_LINES:]:
            try:
                found.append(json.loads(line))
            except ValueError:
                found.append(None)
        return found

    def identity(self) -> str | None:
        """The identity Onceflow wrote here, if any."""
        text = self.read(IDENTITY_FILE)
        return text.strip() if text else None


def choose_manager(
    session: SparkSession, checkpoint: Checkpoint, user_conf: dict[str, str]
) -> None:
    """Write a local checkpoint through Hadoop's FileSystem API rather than FileContext.

    Without Hadoop's native library (PySpark ships none), FileContext forks ``chmod`` for
    every file it creates: the offset and commit logs and their checksum files, four
    processes per micro-batch, measured at ~90 ms of every micro-batch. On a local disk the
    two managers give the same guarantee: both create a log entry by checking that it does
    not exist and then renaming a temporary file over it (``rename(2)`` replaces), so
    neither is an atomic create-if-absent there; fencing drivers by epoch is what keeps two
    drivers from taking turns. HDFS and object stores keep Spark's default, and so does a
    manager the user chose (``spark_conf``).
    """
    if MANAGER_CONF in user_conf:
        return
    conf = session.conf
    current = conf.get(MANAGER_CONF, None)
    if current not in (None, LOCAL_MANAGER):
        return  # set on the session by whoever made it
    if checkpoint.local and _loadable(session, LOCAL_MANAGER):
        conf.set(MANAGER_CONF, LOCAL_MANAGER)
    elif current is not None:
        conf.unset(MANAGER_CONF)


def _loadable(session: SparkSession, name: str) -> bool:
    try:
        session._jvm.java.lang.Class.forName(name)  # type: ignore[union-attr]  # noqa: SLF001
    except Exception:  # noqa: BLE001 - another Spark version: keep its default
        return False
    return True
