"""Line-oriented files: text and JSON-lines sources, and a JSON-lines sink.

Sources split files into byte ranges; a range owns the lines that *start* inside it, so
splits never cut or repeat a line. A record's ID derives from its file and byte offset, and a
line that does not decode becomes a dead letter naming ``path@offset``.

The sink writes one part file per task, atomically (temporary name, then rename). In a
bounded run the driver concatenates the parts, in partition order, into the single file the
user named. In a streaming run the path is a directory of complete part files
``part-<batch>-<partition>-...jsonl``: in an exactly-once run each delivery is staged and
renamed into place when it commits (:mod:`onceflow.connectors.staged`), so a kill at any
point leaves every record in the folder once, and each line holds the record's ID
(``{"id": ..., "value": ...}``) unless ``with_ids=False``; in an at-least-once run every
flush leaves a file.

Files are read and written with plain file I/O by the workers, so on a cluster every worker
must see the same path: give ``shared=True`` for a path on storage every machine mounts at
the same place (NFS ...), or list such folders in ``$ONCEFLOW_SHARED_DIRS`` (``:``
separated, read on the driver). A run on a cluster master refuses any other path (see
:func:`onceflow.runtime.driver.placement.check_paths`): its files would be scattered over, or
missing from, the workers' own disks.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from onceflow.connectors.base import Rejected, SinkConnector, SinkWriter, SourceConnector, TaskInfo
from onceflow.connectors.collections import split_frame, splits_of
from onceflow.connectors.decoded import Decoded, Decoder
from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.local_files import decode_line, is_shared, read_range
from onceflow.connectors.staged import STAGING, StagedFilesWriter, local_folder
from onceflow.kernel.codec import value_codec
from onceflow.kernel.records import Record
from onceflow.kernel.windows import Pane

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

DEFAULT_SPLIT_BYTES = 32 << 20


def _expand(path: str) -> list[str]:
    if os.path.isdir(path):
        found = sorted(
            os.path.join(path, f)
            for f in os.listdir(path)
            if not f.startswith((".", "_")) and os.path.isfile(os.path.join(path, f))
        )
    else:
        found = sorted(p for p in glob.glob(path) if os.path.isfile(p))
    if not found:
        msg = f"no input files match {path!r}; check the path (relative to {os.getcwd()})"
        raise ConnectorError(msg)
    return [os.path.abspath(p) for p in found]


class LineFiles(SourceConnector):
    """Lines of one or more files (a path, a directory or a glob), decoded by a codec."""

    bounded = True

    def __init__(
        self,
        path: str,
        *,
        codec: str = "utf-8",
        split_bytes: int = DEFAULT_SPLIT_BYTES,
        skip_blank: bool = False,
        shared: bool = False,
        timestamp: Callable[[Any], Any] | None = None,
    ) -> None:
        self.path = path
        self.shared = shared
        self.ts_fn = timestamp
        self.codec = value_codec(codec)
        self.split_bytes = split_bytes
        self.skip_blank = skip_blank
        self.ranges: list[tuple[str, int, int]] = []

    def describe(self) -> str:
        """One line for plans."""
        return f"{self.codec.name} lines of {self.path}"

    def prepare(self, pipeline: str, streaming: bool) -> None:
        """Find the files and cut them into ranges."""
        self.ranges = []
        for p in _expand(self.path):
            size = os.path.getsize(p)
            start = 0
            while True:
                end = min(size, start + self.split_bytes)
                self.ranges.append((p, start, end))
                if end >= size:
                    break
                start = end

    def local_paths(self) -> list[str]:
        """The files read, unless they are on shared storage."""
        if self.shared or is_shared(self.path):
            return []
        return sorted({path for path, _, _ in self.ranges}) or [os.path.abspath(self.path)]

    def frame(self, session: SparkSession, parallelism: int) -> DataFrame:
        """One row per byte range."""
        if not self.ranges:
            self.prepare("", False)
        return split_frame(session, len(self.ranges))

    def decoder(self, source: str, with_ids: bool) -> Decoder:
        """Read and decode the lines of each range."""
        ranges, codec, skip_blank, ts_fn = self.ranges, self.codec, self.skip_blank, self.ts_fn

        def decode(batch: pa.RecordBatch) -> Iterator[Decoded]:
            for split, _splits in splits_of(batch):
                path, start, end = ranges[split]
                for offset, line in read_range(path, start, end):
                    if skip_blank and not line.strip():
                        continue
                    yield decode_line(source, path, offset, line, codec, with_ids, ts_fn)

        return decode


def TextFile(  # noqa: N802
    path: str,
    *,
    split_bytes: int = DEFAULT_SPLIT_BYTES,
    shared: bool = False,
    timestamp: Callable[[Any], Any] | None = None,
    watch: bool = False,
    max_files_per_batch: int | None = None,
) -> SourceConnector:
    """Each line of the file(s) as a ``str`` (``shared``: see the module docstring).

    ``timestamp(line)`` gives a line's event time (epoch ms or an aware datetime); a line it
    fails on is a dead letter (``no_time``). ``watch=True``: ``path`` is a folder (or glob)
    read as a stream, each new file once (:mod:`onceflow.connectors.file_stream`).
    """
    if watch:
        from onceflow.connectors.file_stream import FileStream

        return FileStream(
            path,
            codec="utf-8",
            skip_blank=False,
            timestamp=timestamp,
            max_files_per_batch=max_files_per_batch,
            shared=shared,
        )
    if max_files_per_batch is not None:
        msg = "max_files_per_batch= applies to a watched folder (watch=True)"
        raise ConnectorError(msg)
    return LineFiles(
        path, codec="utf-8", split_bytes=split_bytes, shared=shared, timestamp=timestamp
    )


def JsonLinesSource(  # noqa: N802, PLR0913 - a source's options, each with a default
    path: str,
    *,
    split_bytes: int = DEFAULT_SPLIT_BYTES,
    shared: bool = False,
    timestamp: Callable[[Any], Any] | None = None,
    watch: bool = False,
    id: Callable[[Any], Any] | None = None,  # noqa: A002 - reads well at the call site
    max_files_per_batch: int | None = None,
) -> SourceConnector:
    """Each line of the file(s) parsed as JSON (blank lines are not records and are skipped).

    ``timestamp(value)`` gives a record's event time, as for :func:`TextFile`. ``watch=True``:
    ``path`` is a folder (or glob) read as a stream, each new file once, ``id(value)`` naming
    a record's ID when given (else its file and offset), at most ``max_files_per_batch`` files
    per micro-batch (:mod:`onceflow.connectors.file_stream`).
    """
    if watch:
        from onceflow.connectors.file_stream import FileStream

        return FileStream(
            path,
            codec="json",
            skip_blank=True,
            id=id,
            timestamp=timestamp,
            max_files_per_batch=max_files_per_batch,
            shared=shared,
        )
    if id is not None or max_files_per_batch is not None:
        msg = "id= and max_files_per_batch= apply to a watched folder (watch=True)"
        raise ConnectorError(msg)
    return LineFiles(
        path,
        codec="json",
        split_bytes=split_bytes,
        skip_blank=True,
        shared=shared,
        timestamp=timestamp,
    )


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes):
        import base64

        return {"$base64": base64.b64encode(value).decode()}
    if isinstance(value, set | frozenset):
        return sorted(value)
    if isinstance(value, Pane):
        return value.as_dict()
    msg = f"{type(value).__name__} is not JSON serializable"
    raise TypeError(msg)


def to_json_line(value: Any) -> bytes:
    """One JSON line (tuples become arrays, bytes become ``{"$base64": ...}``)."""
    return (json.dumps(value, default=_json_default, ensure_ascii=False) + "\n").encode()


class JsonLinesSink(SinkConnector):
    """Writes elements as JSON lines (see the module docstring for the file layout)."""

    def __init__(self, path: str, *, with_ids: bool | None = None, shared: bool = False) -> None:
        self.path = local_folder(path, "JsonLinesSink")
        self.with_ids = with_ids  # None: in exactly-once runs
        self.shared = shared
        self.streaming = False

    def describe(self) -> str:
        """One line for plans."""
        return f"json lines {self.path}"

    @property
    def parts_dir(self) -> str:
        """Where tasks put their part files."""
        return self.path if self.streaming else self.path + ".parts"

    def prepare(self, pipeline: str, streaming: bool) -> None:
        """Create the directories; a bounded run starts from empty parts."""
        self.streaming = streaming
        if not streaming:
            shutil.rmtree(self.parts_dir, ignore_errors=True)
        os.makedirs(self.parts_dir, exist_ok=True)

    def local_paths(self) -> list[str]:
        """The folder the workers write their parts to, unless it is on shared storage."""
        return [] if self.shared or is_shared(self.path) else [self.parts_dir]

    def staging_folder(self) -> str | None:
        """The staging folder of exactly-once streaming runs."""
        return os.path.join(self.path, STAGING)

    def open(self, task: TaskInfo) -> SinkWriter:
        """A writer for one task: transactional in an exactly-once streaming run."""
        if self.streaming and task.exactly_once:
            return _StagedJsonLines(self, task)
        return _JsonLinesWriter(self, task)

    def finish(self) -> None:
        """Bounded: concatenate the parts into the final file, atomically."""
        if self.streaming or not os.path.isdir(self.parts_dir):
            return
        parts = sorted(f for f in os.listdir(self.parts_dir) if f.startswith("part-"))
        tmp = f"{self.path}.tmp-{uuid.uuid4().hex}"
        with open(tmp, "wb") as out:
            for name in parts:
                with open(os.path.join(self.parts_dir, name), "rb") as fh:
                    shutil.copyfileobj(fh, out)
        os.replace(tmp, self.path)
        shutil.rmtree(self.parts_dir, ignore_errors=True)

    def read(self) -> list[Any]:
        """Every element written so far (bounded: the file; streaming: all part files)."""
        files = (
            [self.path]
            if not self.streaming
            else [
                os.path.join(self.path, f)
                for f in sorted(os.listdir(self.path))
                if f.startswith("part-")
            ]
        )
        out: list[Any] = []
        for f in files:
            if os.path.exists(f):
                with open(f, encoding="utf-8") as fh:
                    out.extend(json.loads(line) for line in fh if line.strip())
        return out


class _StagedJsonLines(StagedFilesWriter):
    """An exactly-once run's deliveries as JSON-lines files (staged, then renamed)."""

    suffix = ".jsonl"
    refusal = "cannot write as JSON"

    def __init__(self, sink: JsonLinesSink, task: TaskInfo) -> None:
        super().__init__(sink.parts_dir, task)
        self.with_ids = sink.with_ids is not False

    def row(self, rec: Record) -> bytes:
        """The record's line."""
        return to_json_line({"id": rec.id.hex(), "value": rec.elem} if self.with_ids else rec.elem)

    def write_file(self, file: Any, rows: list[Any]) -> None:
        """The lines, in order."""
        file.writelines(rows)


class _JsonLinesWriter(SinkWriter):
    def __init__(self, sink: JsonLinesSink, task: TaskInfo) -> None:
        self.sink = sink
        self.task = task
        self.pending: list[bytes] = []
        self.flushes = 0
        self.written: list[str] = []
        safe = task.sink.replace("/", "_")
        self.stem = f"part-{task.batch:06d}-{task.partition:05d}-{safe}"

    def write(self, records: Sequence[Record]) -> list[Rejected]:
        rejected: list[Rejected] = []
        for r in records:
            try:
                with_ids = bool(self.sink.with_ids)
                value = {"id": r.id.hex(), "value": r.elem} if with_ids else r.elem
                self.pending.append(to_json_line(value))
            except (TypeError, ValueError) as exc:
                rejected.append((r, f"cannot write as JSON: {exc}"))
        return rejected

    def flush(self) -> list[Rejected]:
        if not self.pending:
            return []
        if self.sink.streaming:  # every flush is a complete, visible file
            unique = f"{self.task.attempt}-{self.flushes:04d}-{uuid.uuid4().hex[:8]}"
            name = f"{self.stem}-{unique}.jsonl"
            self._publish(name, self.pending)
            self.pending = []
            self.flushes += 1
        return []

    def close(self) -> None:
        if self.sink.streaming:
            self.flush()
        elif self.pending:
            self._publish(f"{self.stem}.jsonl", self.pending)
            self.pending = []

    def abort(self) -> None:
        self.pending = []

    def _publish(self, name: str, lines: list[bytes]) -> None:
        final = os.path.join(self.sink.parts_dir, name)
        tmp = os.path.join(self.sink.parts_dir, f".tmp-{uuid.uuid4().hex}")
        with open(tmp, "wb") as fh:
            fh.writelines(lines)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        self.written.append(final)


def Csv(  # noqa: N802, PLR0913 - a source's options, each with a default
    path: str,
    *,
    watch: bool = False,
    header: bool = True,
    columns: list[str] | None = None,
    delimiter: str = ",",
    id: Callable[[Any], Any] | None = None,  # noqa: A002 - reads well at the call site
    timestamp: Callable[[Any], Any] | None = None,
    max_files_per_batch: int | None = None,
    shared: bool = False,
) -> SourceConnector:
    """Each record of each new CSV file in a folder, as a dict (:mod:`.csv_rows`).

    ``watch=True`` is required (a bounded CSV source is not built). ``header``: each file's
    first record names the fields (default); ``columns``: the names, for files without a
    header; neither: a list per record. ``id``, ``timestamp``, ``max_files_per_batch`` and
    ``shared`` as for :func:`~onceflow.connectors.files.JsonLinesSource`.
    """
    from onceflow.connectors.csv_rows import CsvRows
    from onceflow.connectors.file_stream import FileStream

    if not watch:
        msg = "a CSV folder is read as a stream: sources.Csv(path, watch=True)"
        raise ConnectorError(msg)
    rows = CsvRows(header, tuple(columns) if columns else None, delimiter)
    return FileStream(
        path,
        codec=rows,
        skip_blank=True,
        id=id,
        timestamp=timestamp,
        max_files_per_batch=max_files_per_batch,
        shared=shared,
    )
