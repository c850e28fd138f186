"""``onceflow compact``: a Parquet sink's small files merged, while its pipeline runs or not.

An exactly-once streaming run writes one file per delivery and folder (see
:mod:`onceflow.connectors.staged`): a short trigger and many partitions make many small files.
Only files that no retry can touch are merged: those of micro-batches up to the last one
Spark committed, which the namespace's acknowledged batch says
(:func:`onceflow.backup.store.acknowledged`; a Redis that went back says less, never more). A
retry only ever looks at the files of the batch it runs again, and the sink's marks live
elsewhere (``_onceflow_marks``), so merging never makes a retry write a delivery twice.

Per folder (``country=FR/`` ...), files up to ``target_bytes`` in all are merged into one
``compacted-<first batch>-<last batch>-<token>.parquet``, crash-safe at every step:

1. the merged file is written and fsynced under ``<sink>/_onceflow_compaction/``;
2. a manifest beside it names the merged file and its sources (fsynced: the intent);
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

import fcntl
import json
import os
import re
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from onceflow.backup.store import acknowledged
from onceflow.connectors.parquet import ParquetSink
from onceflow.kernel.keyspace import Keyspace

WORK = "_onceflow_compaction"
LOCK = ".lock"
DEFAULT_TARGET_BYTES = 128 << 20
_PART = re.compile(r"^part-(\d+)-.*\.parquet$")
_MERGED = re.compile(r"^compacted-(\d+)-(\d+)-[0-9a-f]+\.parquet$")


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
    up_to = acknowledged(client, Keyspace(namespace))
    with _one_at_a_time(sink.path):
        done = Compaction(name, sink.path, up_to, finished=recover(sink.path))
        for folder, files in _final_files(sink.path, up_to):
            for group in _groups(folder, files, target_bytes):
                try:
                    _merge(sink.path, folder, group, done, crash)
                except _Unmergeable:
                    done.left.append(os.path.relpath(folder, sink.path) or ".")
                    break
    return done


@contextmanager
def _one_at_a_time(root: str) -> Iterator[None]:
    """An exclusive lock on the sink's compaction folder: cron runs that overlap take turns."""
    work = os.path.join(root, WORK)
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, LOCK), "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def recover(root: str) -> int:
    """Finish or drop every merge an interrupted compaction left; how many there were."""
    work = os.path.join(root, WORK)
    if not os.path.isdir(work):
        return 0
    found = 0
    for name in sorted(os.listdir(work)):
        path = os.path.join(work, name)
        if not name.endswith(".json"):
            if name.endswith(".parquet") and not os.path.exists(path[: -len(".parquet")] + ".json"):
                _unlink(path)  # staged before its manifest was written: never renamed
            continue
        found += 1
        with open(path, encoding="utf-8") as fh:
            manifest = json.load(fh)
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


def _final_files(root: str, up_to: int) -> Iterator[tuple[str, list[str]]]:
    """Per folder of the sink, its files of micro-batches up to ``up_to``, and merged ones."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(("_", ".")))
        final = []
        for name in sorted(files):
            part = _PART.match(name)
            if (part and int(part.group(1)) <= up_to) or _MERGED.match(name):
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


def _batches(names: Sequence[str]) -> tuple[int, int]:
    found: list[int] = []
    for name in names:
        part, merged = _PART.match(name), _MERGED.match(name)
        if part:
            found.append(int(part.group(1)))
        elif merged:
            found += [int(merged.group(1)), int(merged.group(2))]
    return min(found), max(found)


def _merge(root: str, folder: str, names: list[str], done: Compaction, crash: Any) -> None:
    """Steps 1-3 of the module docstring for one group of files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        tables = [pq.ParquetFile(os.path.join(folder, n)).read() for n in names]
        merged = pa.concat_tables(tables, promote_options="default")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise _Unmergeable(str(exc)) from None
    work = os.path.join(root, WORK)
    os.makedirs(work, exist_ok=True)
    token = uuid.uuid4().hex[:12]
    first, last = _batches(names)
    target = f"compacted-{first:06d}-{last:06d}-{token}.parquet"
    staged = os.path.join(work, f"{token}.parquet")
    _step(crash, "write")
    with open(staged, "wb") as fh:
        pq.write_table(merged, fh)
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
        os.unlink(os.path.join(folder, name))
    _sync(folder)
    _step(crash, "forget")
    os.unlink(os.path.join(work, f"{token}.json"))
    done.merged += len(names)
    done.written += 1


def _step(crash: Any, name: str) -> None:
    if crash is not None:
        crash(name)


def _write_synced(path: str, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
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
