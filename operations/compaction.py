"""``onceflow compact``: a Parquet sink's small files merged, while its pipeline runs or not.

An exactly-once streaming run writes one file per delivery and folder (see
:mod:`onceflow.connectors.staged`): a short trigger and many partitions make many small files.
Only files that no retry can touch are merged: this sink's files (its name is in theirs) of
micro-batches up to the last one Spark committed, which the namespace's acknowledged batch
says (:func:`onceflow.backup.store.acknowledged`, read under the lock; a Redis that went back
says less, never more), and older than their sink partition's newest (whose delivery may be
the pending one a retry asks about). A retry only ever looks at that delivery's files, and the
sink's marks live elsewhere (``_onceflow_marks``), so merging never makes a retry write a
delivery twice.

Per folder (``country=FR/`` ...), files up to ``target_bytes`` in all are merged into one
``compacted-<first batch>-<last batch>-<sink>-<token>.parquet`` (with the sink's compression
and row-group size), crash-safe at every step:

1. the merged file is written and fsynced under ``<sink>/_onceflow_compaction/``;
2. a manifest beside it names the merged file and its sources (written under a temporary
   name, fsynced, renamed: the intent, whole or absent);
3. the merged file is renamed into place, then the sources are deleted, then the manifest.

A compaction killed anywhere is finished by the next one (:func:`recover`): a manifest whose
merged file is in place has its remaining sources deleted; one whose merged file is not is
dropped with its staged file, and the sources stay. Nothing is lost and, once a compaction has
ended, nothing is there twice. A reader listing the folder *during* step 3 can see a source
and the merged file at once (a folder has no atomic multi-file swap): rows carry their ID
(``_onceflow_id``) for readers that must never count twice; a table format (the Iceberg sink)
swaps files atomically. Files whose columns cannot be merged into one schema are left as they
are, and said so.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from onceflow.backup.store import acknowledged
from onceflow.connectors.parquet import ParquetSink
from onceflow.connectors.staged import COMPACTION, compaction_lock
from onceflow.kernel.keyspace import Keyspace

WORK = COMPACTION
DEFAULT_TARGET_BYTES = 128 << 20


@dataclass(frozen=True)
class _Names:
    """The file names of one sink: its parts and its merged files.

    Parts are ``part-<batch>-<partition>-<sink>-<digest>`` (see
    :mod:`onceflow.connectors.staged`); another sink's files in the same folder are never
    touched.
    """

    part: re.Pattern[str]
    merged: re.Pattern[str]
    sink: str

    @classmethod
    def of(cls, sink: str) -> _Names:
        quoted = re.escape(quote(sink, safe=""))
        return cls(
            re.compile(rf"^part-(\d+)-(\d+)-{quoted}-[0-9a-f]+\.parquet$"),
            re.compile(rf"^compacted-(\d+)-(\d+)-{quoted}-[0-9a-f]+\.parquet$"),
            quote(sink, safe=""),
        )


@dataclass
class Compaction:
    """What one sink's compaction did."""

    sink: str
    path: str
    up_to_batch: int
    merged: int = 0  # files merged away
    written: int = 0  # merged files written
    left: list[str] = field(default_factory=list)  # folders whose files could not merge
    finished: int = 0  # an earlier compaction's merges finished (or dropped) first

    def text(self) -> str:
        """One line for the command line."""
        line = (
            f"{self.sink} ({self.path}): {self.merged} file(s) of micro-batches up to "
            f"{self.up_to_batch} merged into {self.written}"
        )
        if self.finished:
            line += f"; {self.finished} interrupted merge(s) of an earlier compaction finished"
        if self.left:
            line += f"; left as they are (columns that do not merge): {', '.join(self.left)}"
        return line


def parquet_sinks(pipeline: Any) -> dict[str, ParquetSink]:
    """The pipeline's Parquet sinks, by sink stage name."""
    return {
        node.name: node.connector
        for node in pipeline.graph.nodes
        if node.kind == "sink" and isinstance(node.connector, ParquetSink)
    }


def compact(
    client: Any,
    namespace: str,
    name: str,
    sink: ParquetSink,
    target_bytes: int = DEFAULT_TARGET_BYTES,
    crash: Any = None,
) -> Compaction:
    """Merge the sink's small files of committed micro-batches (see the module docstring).

    ``crash``: a test's hook, called with the step's name before each step.
    """
    names = _Names.of(name)
    with compaction_lock(sink.path):
        # read under the lock: a compaction waited for may have taken long
        up_to = acknowledged(client, Keyspace(namespace))
        done = Compaction(name, sink.path, up_to, finished=recover(sink.path))
        newest = _newest_batches(sink.path, names)
        for folder, files in _final_files(sink.path, names, up_to, newest):
            for group in _groups(folder, files, target_bytes):
                try:
                    _merge(sink, folder, group, names, done, crash)
                except _Unmergeable:
                    where = os.path.relpath(folder, sink.path)
                    if where not in done.left:
                        done.left.append(where)
    return done


def recover(root: str) -> int:
    """Finish or drop every merge an interrupted compaction left; how many there were."""
    work = os.path.join(root, WORK)
    if not os.path.isdir(work):
        return 0
    found = 0
    for name in sorted(os.listdir(work)):
        path = os.path.join(work, name)
        if name.endswith(".json.tmp"):
            _unlink(path)  # a manifest cut while written: never renamed, nor its merge
            continue
        if not name.endswith(".json"):
            if name.endswith(".parquet") and not os.path.exists(path[: -len(".parquet")] + ".json"):
                _unlink(path)  # staged before its manifest was written: never renamed
            continue
        found += 1
        with open(path, encoding="utf-8") as fh:
            manifest = json.load(fh)  # whole: written to a temporary name, then renamed
        target = os.path.join(root, manifest["target"])
        staged = os.path.join(work, manifest["staged"])
        if os.path.exists(target) and not os.path.exists(staged):
            for source in manifest["sources"]:
                _unlink(os.path.join(root, source))
        else:
            _unlink(staged)  # not renamed: the sources stay, the merge never happened
        os.unlink(path)
    _sync(work)
    return found


class _Unmergeable(Exception):
    """The files' columns do not merge into one schema."""


def _newest_batches(root: str, names: _Names) -> dict[int, int]:
    """Each sink partition's newest micro-batch with a file here.

    Its delivery may be the one a retry of the partition still asks about (a pending delivery),
    so it is never merged.
    """
    newest: dict[int, int] = {}
    for _folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
        for name in files:
            part = names.part.match(name)
            if part:
                batch, partition = int(part.group(1)), int(part.group(2))
                newest[partition] = max(newest.get(partition, -1), batch)
    return newest


def _final_files(
    root: str, names: _Names, up_to: int, newest: dict[int, int]
) -> Iterator[tuple[str, list[str]]]:
    """Per folder of the sink, its files no retry can look at, and its merged ones.

    Parts of micro-batches up to ``up_to`` and older than their partition's newest.
    """
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(("_", ".")))
        final = []
        for name in sorted(files):
            part = names.part.match(name)
            if part:
                batch, partition = int(part.group(1)), int(part.group(2))
                if batch <= up_to and batch < newest[partition]:
                    final.append(name)
            elif names.merged.match(name):
                final.append(name)
        if final:
            yield folder, final


def _groups(folder: str, files: Sequence[str], target_bytes: int) -> Iterator[list[str]]:
    """Runs of small files up to ``target_bytes`` in all, two files or more each."""
    group: list[str] = []
    size = 0
    for name in files:
        n = os.path.getsize(os.path.join(folder, name))
        if n >= target_bytes:
            continue
        if group and size + n > target_bytes:
            if len(group) > 1:
                yield group
            group, size = [], 0
        group.append(name)
        size += n
    if len(group) > 1:
        yield group


def _batches(names: Sequence[str], patterns: _Names) -> tuple[int, int]:
    found: list[int] = []
    for name in names:
        part, merged = patterns.part.match(name), patterns.merged.match(name)
        if part:
            found.append(int(part.group(1)))
        elif merged:
            found += [int(merged.group(1)), int(merged.group(2))]
    return min(found), max(found)


def _merge(
    sink: ParquetSink, folder: str, names: list[str], patterns: _Names, done: Compaction, crash: Any
) -> None:
    """Steps 1-3 of the module docstring for one group of files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = sink.path
    try:
        tables = [pq.ParquetFile(os.path.join(folder, n)).read() for n in names]
        merged = pa.concat_tables(tables, promote_options="default")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise _Unmergeable(str(exc)) from None
    work = os.path.join(root, WORK)
    os.makedirs(work, exist_ok=True)
    token = uuid.uuid4().hex[:12]
    first, last = _batches(names, patterns)
    target = f"compacted-{first:06d}-{last:06d}-{patterns.sink}-{token}.parquet"
    staged = os.path.join(work, f"{token}.parquet")
    _step(crash, "write")
    with open(staged, "wb") as fh:
        pq.write_table(merged, fh, compression=sink.compression, row_group_size=sink.row_group_size)
        fh.flush()
        os.fsync(fh.fileno())
    manifest = {
        "target": os.path.relpath(os.path.join(folder, target), root),
        "staged": f"{token}.parquet",
        "sources": [os.path.relpath(os.path.join(folder, n), root) for n in names],
    }
    _step(crash, "manifest")
    _write_synced(os.path.join(work, f"{token}.json"), json.dumps(manifest).encode())
    _step(crash, "rename")
    os.rename(staged, os.path.join(folder, target))
    _sync(folder)
    _sync(work)
    for i, name in enumerate(names):
        _step(crash, f"delete {i}")
        _unlink(os.path.join(folder, name))
    _sync(folder)
    _step(crash, "forget")
    os.unlink(os.path.join(work, f"{token}.json"))
    done.merged += len(names)
    done.written += 1


def _step(crash: Any, name: str) -> None:
    if crash is not None:
        crash(name)


def _write_synced(path: str, data: bytes) -> None:
    """``data`` at ``path`` whole or not at all: written under a temporary name, renamed."""
    with open(path + ".tmp", "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.rename(path + ".tmp", path)
    _sync(os.path.dirname(path))


def _sync(folder: str) -> None:
    """Make the renames and deletes in ``folder`` durable (an fsync of the folder)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
