"""A folder as a stream: new files' lines read as they land, exactly once across restarts.

``JsonLinesSource(folder, watch=True)``, ``TextFile(folder, watch=True)`` and
``ParquetSource(folder, watch=True)`` make a :class:`FileStream`. Which files are new is
Spark's own file stream source's business: it lists the folder (or glob) at each micro-batch
and keeps the names it has handed out in the query's checkpoint, so a replayed micro-batch
reads the same files and a restarted query never reads a file twice nor skips one, whatever
the files' clocks say. It hands over one row per file (its path, time and length, never its
content); the source stage's task reads the file itself, a slice at a time.

A record's ID is its file and byte offset (or the ``id`` function's key): a file copied under
another name is another file, unless an ``id`` function names the records. Its event time is
``timestamp(value)``, else the file's modification time. A line that does not decode is a
dead letter naming ``path@offset`` (``undecodable``); a file that is gone or forbidden when its
task reads it is one letter naming the file (``unreadable``; other I/O errors fail the task,
which Spark retries); a file shorter or longer than Spark's scan measured it says so in a
letter (``truncated``, ``file_grew``: nothing after that length is read); so does a line over
``max_line_bytes`` (256 MiB: a binary file with no newline), skipped without being held whole.

What the folder's writers must do (as for Spark's file source): a file is complete when it
appears (write it elsewhere, or under a name starting with ``.`` or ``_``, never read, and
rename it in); it is never appended to or rewritten afterwards (Spark never lists a path
twice: what is appended later is never read, and a file made again under a name already read
is not read); it is not deleted or moved before its micro-batch committed (Spark would skip
it on a replay with only a warning in its log: the run stops instead, naming the file, until
it is back; see :meth:`FileStream.check_batch`).

Files are read with plain file I/O by the workers, so on a cluster the folder must be on
storage every machine mounts at the same place (``shared=True``, or ``$ONCEFLOW_SHARED_DIRS``;
see :mod:`onceflow.connectors.files`).
"""

from __future__ import annotations

import errno
import glob
import json
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from onceflow.connectors.base import SourceCapabilities, SourceConnector, SourceRun
from onceflow.connectors.csv_rows import CsvRows
from onceflow.connectors.decoded import Decoded, Decoder
from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.local_files import (
    checksum,
    decode_line,
    hive_values,
    is_shared,
    read_lines,
)
from onceflow.connectors.parquet import ID_COLUMN
from onceflow.kernel import ids
from onceflow.kernel.codec import ValueCodec, value_codec
from onceflow.kernel.eventtime import as_event_time
from onceflow.kernel.limits import MAX_CHUNK_BYTES
from onceflow.kernel.records import DeadLetter, Record

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

# Spark's binaryFile source, asked for no content: one row per new file (content never read).
LISTING_SCHEMA = "path string, modificationTime timestamp, length long, content binary"
# What a file stream hands the source stage: Kafka's range columns (a query may union both).
RANGE_COLUMNS = ("topic", "partition", "lo", "hi")
# Spark forgets files older than this (relative to the newest) and would not read them: far
# enough that a file copied with its old time kept is read, not silently skipped.
MAX_FILE_AGE = "36500d"
# Errors that say the file itself is not readable (a letter); any other fails the task.
FILE_GONE = frozenset({errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR})
# The longest line read (FileStream(max_line_bytes=...)): the largest max_record_bytes a
# pipeline may set. A longer line (a binary file with no newline) is a dead letter without
# being held whole; shorter ones meet the pipeline's own max_record_bytes.
MAX_LINE_BYTES = MAX_CHUNK_BYTES
PARQUET = "parquet"  # FileStream(codec=...): rows of Parquet files, not lines
PARQUET_ROWS = 2048  # rows decoded at a time


def logged_files(read: Callable[[str], str | None], offset: int) -> list[str]:
    """The local paths Spark's file source log lists for one of its log offsets.

    Each offset is a file ``<offset>`` of ``v1`` then JSON entries (``path`` a percent-encoded
    URI); every ``compact_interval``-th (10) is ``<offset>.compact`` with every entry so far,
    and the single files before it are deleted after a while: the entries are then found in
    the next compacted file. ``[]`` when neither is found.
    """
    text = read(str(offset))
    if text is None:
        for name in (f"{offset}.compact", f"{(offset // 10 + 1) * 10 - 1}.compact"):
            text = read(name)
            if text is not None:
                break
    if text is None:
        return []
    paths = []
    for line in text.splitlines()[1:]:
        entry = json.loads(line) if line.strip() else {}
        if entry.get("batchId", offset) == offset and "path" in entry:
            paths.append(unquote(urlparse(entry["path"]).path))
    return paths


def watched_folder(path: str) -> str:
    """The folder of ``path``: itself, or a glob's folder (its parts before the first pattern)."""
    parts = os.path.abspath(path).split(os.sep)
    magic = next((i for i, p in enumerate(parts) if glob.has_magic(p) or "{" in p), len(parts))
    return os.sep.join(parts[:magic]) or os.sep


def local_path(uri: str) -> str:
    """A local path from what Spark lists (``file:/data/in/a b.jsonl``, ``file:///...``).

    Spark lists a path as it is on disk, not percent-encoded: ``%20`` in a name stays.
    """
    if uri.startswith("file://"):
        return uri[len("file://") :]
    if uri.startswith("file:"):
        return uri[len("file:") :]
    if urlparse(uri).scheme:
        msg = f"a watched folder is read with plain file I/O; {uri!r} is not a local path"
        raise ConnectorError(msg)
    return uri


class FileStream(SourceConnector):
    """New files of a folder or glob, a line at a time, decoded by a codec (see the module)."""

    bounded = False

    def __init__(  # noqa: PLR0913 - a source's options, each with a default
        self,
        path: str,
        *,
        codec: str | ValueCodec | CsvRows = "json",
        skip_blank: bool = True,
        id: Callable[[Any], Any] | None = None,  # noqa: A002 - reads well at the call site
        timestamp: Callable[[Any], Any] | None = None,
        max_files_per_batch: int | None = None,
        shared: bool = False,
        max_line_bytes: int = MAX_LINE_BYTES,
        recursive: bool = False,
    ) -> None:
        if max_files_per_batch is not None and max_files_per_batch < 1:
            msg = f"max_files_per_batch must be 1 or more, got {max_files_per_batch}"
            raise ConnectorError(msg)
        self.path = path
        self.parquet = codec == PARQUET
        self.recursive = recursive
        self.codec = (
            value_codec("raw" if self.parquet else codec) if isinstance(codec, str) else codec
        )
        self.skip_blank = skip_blank
        self.id_fn = id
        self.ts_fn = timestamp
        self.max_files_per_batch = max_files_per_batch
        self.shared = shared
        self.max_line_bytes = max_line_bytes
        # the folder watched (a glob's folder), the source's one lane of event time: made
        # absolute here, on the driver (a worker's current folder may be another)
        self.folder = watched_folder(path)

    def describe(self) -> str:
        """One line for plans."""
        what = "Parquet rows" if self.parquet else f"{self.codec.name} lines"
        return f"{what} of new files in {self.path}" + " and its folders" * self.recursive

    def capabilities(self) -> SourceCapabilities:
        """Its task reads each file; Spark plans which task reads which file (not stable)."""
        return SourceCapabilities(reads_in_task=True, stable_partitions=False, checks_batches=True)

    def for_run(self, run: SourceRun) -> FileStream:
        """The same source; refused beside a source whose raw rows the query carries."""
        if not run.read_in_task:
            msg = (
                f"a watched folder ({self.path}) is read by its own stage's task; it cannot be "
                "one query with a source read outside the task (KafkaSource(read_in_task=False))"
            )
            raise ConnectorError(msg)
        return self

    def prepare(self, pipeline: str, streaming: bool) -> None:
        """The folder must exist; its files may come later."""
        if not os.path.isdir(self.folder):
            msg = f"the watched folder {self.folder!r} does not exist; create it first"
            raise ConnectorError(msg)

    def local_paths(self) -> list[str]:
        """The folder, unless it is on shared storage."""
        return [] if self.shared or is_shared(self.path) else [self.folder]

    def positions(self, offsets: Any) -> dict[tuple[str, int], int]:
        """How many listings Spark has logged: ``{(folder, 0): n}``."""
        if isinstance(offsets, dict) and isinstance(offsets.get("logOffset"), int):
            return {(self.folder, 0): offsets["logOffset"]}
        return {}

    def check_batch(self, read: Callable[[str], str | None], start: Any, end: Any) -> None:
        """Stop before a micro-batch one of whose files is gone (Spark would skip it silently).

        The files of a micro-batch are those Spark's source log lists for its log offsets
        ``(start, end]``; a file removed since it was listed (before its micro-batch committed)
        stops the run with one line naming it, instead of being dropped with a log warning.
        """
        first = start.get("logOffset", -1) if isinstance(start, dict) else -1
        last = end.get("logOffset") if isinstance(end, dict) else None
        if not isinstance(last, int):
            return
        missing = [
            path
            for offset in range(int(first) + 1, last + 1)
            for path in logged_files(read, offset)
            if not os.path.exists(path)
        ]
        if missing:
            shown = ", ".join(missing[:3]) + (
                f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            )
            msg = (
                f"{len(missing)} file(s) of the watched folder {self.folder} were listed for "
                f"this micro-batch and are gone before it committed: {shown}. Put them back "
                "(a file may be removed once its micro-batch committed), or start the pipeline "
                "over with a new checkpoint and namespace to go on without them"
            )
            raise ConnectorError(msg)

    def stream(self, session: SparkSession, pipeline: str, source: str) -> DataFrame:
        """One row per new file: its path and length as Kafka's range columns."""
        from pyspark.sql import functions as F  # noqa: N812

        reader = session.readStream.format("binaryFile").schema(LISTING_SCHEMA)
        reader = reader.option("maxFileAge", MAX_FILE_AGE)
        if self.recursive:
            reader = reader.option("recursiveFileLookup", "true")
        if self.max_files_per_batch is not None:
            reader = reader.option("maxFilesPerTrigger", str(self.max_files_per_batch))
        listed = reader.load(self.path)
        return listed.select(  # "lo" carries the file's time: its records' default event time
            F.col("path").alias("topic"),
            F.lit(0).cast("int").alias("partition"),
            F.expr("unix_millis(modificationTime)").alias("lo"),
            F.col("length").alias("hi"),
        )

    def decoder(self, source: str, with_ids: bool) -> Decoder:
        """Each listed file's lines, read in the task, to records."""
        reading = _Reading(source, with_ids, self.codec, self.skip_blank, self.id_fn, self.ts_fn)
        reading.cap, reading.parquet = self.max_line_bytes, self.parquet
        lane = self.folder

        def decode(batch: pa.RecordBatch) -> Iterator[Decoded]:
            columns = batch.to_pydict()
            listed = zip(columns[RANGE_COLUMNS[0]], columns["lo"], columns["hi"], strict=True)
            for uri, mtime, length in listed:
                yield from reading.file(lane, uri, int(length), int(mtime or 0))

        return decode


class _Reading:
    """How one source stage reads a listed file (picklable: it travels to the workers)."""

    def __init__(  # noqa: PLR0913 - what decoding a line needs
        self,
        source: str,
        with_ids: bool,
        codec: ValueCodec | CsvRows,
        skip_blank: bool,
        id_fn: Callable[[Any], Any] | None,
        ts_fn: Callable[[Any], Any] | None,
    ) -> None:
        self.source, self.with_ids, self.codec = source, with_ids, codec
        self.skip_blank, self.id_fn, self.ts_fn = skip_blank, id_fn, ts_fn
        self.cap = MAX_LINE_BYTES
        self.parquet = False
        self.file_ms = 0  # the file being read's modification time: the default event time

    def file(self, lane: str, uri: str, length: int, mtime_ms: int = 0) -> Iterator[Decoded]:
        """The lines of ``[0, length)``; dead letters for a file unreadable, cut or grown.

        A file that is gone, forbidden or not a file is a letter; any other error (an NFS
        server that does not answer, EIO) fails the task, which Spark retries.
        """
        path = local_path(uri)
        self.file_ms = mtime_ms
        try:
            size = os.path.getsize(path)
            if self.parquet:
                yield from self._parquet(lane, path, size, length)
                return
            yield from self._lines(lane, path, min(size, length))
        except OSError as exc:
            if exc.errno not in FILE_GONE:
                raise
            yield self._letter(path, f"cannot read the file: {exc}", "unreadable")
            return
        if size < length:
            why = f"the file is {size} bytes, {length} when it was found: the rest is lost"
            yield self._letter(path, why, "truncated", at=size)
        elif size > length:
            why = (
                f"the file grew from {length} to {size} bytes after it was found; bytes after "
                f"{length} are not read (write files elsewhere and rename them into the folder)"
            )
            yield self._letter(path, why, "file_grew", at=length)

    def _parquet(self, lane: str, path: str, size: int, length: int) -> Iterator[Decoded]:
        """A Parquet file's rows, read whole; one letter if it changed or cannot be read."""
        if size != length:
            why = f"the file is {size} bytes, {length} when found: a Parquet file is read whole"
            yield self._letter(path, why, "file_changed")
            return
        import pyarrow.parquet as pq

        folders = hive_values(lane, path)
        row = 0
        try:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=PARQUET_ROWS):
                size = batch.nbytes // max(batch.num_rows, 1) or 1  # for the byte budgets
                for elem in batch.to_pylist():
                    yield self._row(lane, path, row, {**folders, **elem}, size)
                    row += 1
        except Exception as exc:  # noqa: BLE001 - a cut or foreign file: one letter, named
            why = f"cannot read the Parquet file after {row} rows: {type(exc).__name__}: {exc}"
            yield self._letter(path, why, "unreadable", at=row)

    def _row(self, lane: str, path: str, row: int, elem: dict[str, Any], size: int) -> Decoded:
        """One Parquet row: its ID from the column Onceflow's sink wrote, ``id``, or its place."""
        where = f"{path}#{row}"
        written = elem.pop(ID_COLUMN, None)
        rid, printed = b"", 0
        if self.with_ids:
            rid = ids.from_position(self.source, path, 0, row)
            try:
                if written is not None:
                    rid = bytes.fromhex(written)
                    if len(rid) != ids.ID_BYTES:
                        msg = f"{ID_COLUMN} holds {len(rid)} bytes, not {ids.ID_BYTES}"
                        raise ValueError(msg)
                elif self.id_fn is not None:
                    rid = ids.from_user_key(self.id_fn(elem))
            except Exception as exc:  # noqa: BLE001 - the user's id function, or a bad column
                error = f"no record ID: {type(exc).__name__}: {exc}"
                return DeadLetter(rid, 0, self.source, error, where, value=repr(elem), code="no_id")
            if written is not None or self.id_fn is not None:  # columns a merge added: None
                present = sorted((k, v) for k, v in elem.items() if v is not None)
                printed = checksum(repr(present).encode())
        try:
            ts = as_event_time(self.ts_fn(elem)) if self.ts_fn is not None else self.file_ms
        except Exception as exc:  # noqa: BLE001 - the user's timestamp function failed
            error = f"no event time: {type(exc).__name__}: {exc}"
            return DeadLetter(rid, 0, self.source, error, where, value=repr(elem), code="no_time")
        return Record(rid, ts, elem, lane, row, False, size, printed)

    def _lines(self, lane: str, path: str, end: int) -> Iterator[Decoded]:
        skip_blank, codec = self.skip_blank, self.codec
        lines = read_lines(path, end, self.cap)
        if isinstance(codec, CsvRows):  # records that may span lines, a header per file
            lines, codec = codec.file(lines)
        for offset, line, size in lines:
            if line is None:
                yield self._too_long(path, offset, size)
            elif not (skip_blank and not line.strip()):
                yield decode_line(
                    self.source,
                    path,
                    offset,
                    line,
                    codec,
                    self.with_ids,
                    self.ts_fn,
                    id_fn=self.id_fn,
                    lane=lane,
                    default_ts=self.file_ms,
                )

    def _too_long(self, path: str, offset: int, size: int) -> DeadLetter:
        """A line over ``max_line_bytes``: a letter, never held in memory whole."""
        rid = ids.from_position(self.source, path, 0, offset) if self.with_ids else b""
        error = f"the line is {size} bytes, over the {self.cap} bytes a line may be"
        return DeadLetter(rid, 0, self.source, error, f"{path}@{offset}", code="too_large")

    def _letter(self, path: str, error: str, code: str, at: int = 0) -> DeadLetter:
        """A letter for the file itself: an ID no line of it has (partition 1, not 0)."""
        rid = ids.from_position(self.source, path, 1, at) if self.with_ids else b""
        return DeadLetter(rid, 0, self.source, error, f"{path}@{at}", None, None, code)


def ParquetSource(  # noqa: N802, PLR0913 - a source's options, each with a default
    path: str,
    *,
    watch: bool = False,
    id: Callable[[Any], Any] | None = None,  # noqa: A002 - reads well at the call site
    timestamp: Callable[[Any], Any] | None = None,
    max_files_per_batch: int | None = None,
    shared: bool = False,
    recursive: bool = True,
) -> FileStream:
    """Each row of each new Parquet file in a folder, as a dict, in a streaming run.

    ``watch=True`` is required (a bounded Parquet source is not built). Rows a Parquet sink of
    Onceflow wrote keep their IDs (the ``_onceflow_id`` column), so one pipeline reading
    another's files stays exactly once; else ``id(row)``, else the file and row number. With
    ``recursive`` (the default) files in sub-folders are read too, and a folder named
    ``user=u1`` adds ``"user": "u1"`` to its rows (a ``partition_by`` sink's layout).
    """
    if not watch:
        msg = "a Parquet folder is read as a stream: ParquetSource(path, watch=True)"
        raise ConnectorError(msg)
    return FileStream(
        path,
        codec=PARQUET,
        id=id,
        timestamp=timestamp,
        max_files_per_batch=max_files_per_batch,
        shared=shared,
        recursive=recursive,
    )
