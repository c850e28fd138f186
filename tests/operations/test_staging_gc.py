"""``onceflow gc`` clears what killed attempts of a file sink staged, and nothing else.

Real files written by the Parquet sink's writer, a real Redis namespace listing the sink's
staging folder (as a run's start leaves it), and GC's pass over it.
"""

from __future__ import annotations

import json
import os
import time

import pyarrow.dataset as ds
import pytest

from onceflow.connectors.base import TaskInfo
from onceflow.connectors.parquet import STAGING, ParquetSink
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.records import Record
from onceflow.operations.gc import collect
from onceflow.operations.staging import clear_staging
from onceflow.runtime.driver.pinning import note_staging

HOUR = 3600


def _records(n: int, start: int = 0) -> list[Record]:
    return [Record(i.to_bytes(16, "big"), 1000 + i, {"n": i}) for i in range(start, start + n)]


def _staged(path: str) -> list[str]:
    return sorted(f for _d, _s, fs in os.walk(os.path.join(path, STAGING)) for f in fs)


def _stage(sink: ParquetSink, partition: int, records: list[Record], age_s: float = 0):
    """A killed attempt: its delivery staged (and recorded), never renamed."""
    w = sink.open(TaskInfo("p", "files", 3, partition, 0, exactly_once=True))
    w.write(records)
    w.prepare()
    if age_s:
        then = time.time() - age_s
        for staging, _final in w.staged:
            os.utime(staging, (then, then))
    return w


def test_old_leftovers_go_and_a_live_delivery_stays(tmp_path):
    sink = ParquetSink(str(tmp_path / "out"))
    sink.prepare("p", streaming=True)
    _stage(sink, 1, _records(5), age_s=2 * HOUR)  # a partition that never runs again
    live = _stage(sink, 2, _records(5, 5))  # staged a moment ago, about to be renamed
    assert len(_staged(sink.path)) == 2

    seen = clear_staging([sink.staging_folder()], HOUR, dry_run=True)
    assert (seen.files, len(_staged(sink.path))) == (1, 2), "a dry run deletes nothing"
    cleared = clear_staging([sink.staging_folder()], HOUR, dry_run=False)
    assert cleared.files == 1 and cleared.bytes > 0
    assert len(_staged(sink.path)) == 1
    live.commit()  # the live attempt's rename still works
    rows = ds.dataset(sink.path, format="parquet").to_table().to_pylist()
    assert sorted(r["n"] for r in rows) == list(range(5, 10))


def test_a_staged_file_deleted_under_a_paused_attempt_is_written_again(tmp_path):
    sink = ParquetSink(str(tmp_path / "out"))
    sink.prepare("p", streaming=True)
    paused = _stage(sink, 1, _records(4), age_s=2 * HOUR)
    clear_staging([sink.staging_folder()], HOUR, dry_run=False)
    with pytest.raises(FileNotFoundError):
        paused.commit()  # its rename fails: nothing of it became visible
    retry = sink.open(TaskInfo("p", "files", 3, 1, 1, exactly_once=True))
    finals = [os.path.relpath(final, sink.path) for _staging, final in paused.staged]
    assert not retry.committed(json.dumps(finals))
    retry.settle([retry.identity])
    retry.write(_records(4))
    retry.prepare()
    retry.commit()
    rows = ds.dataset(sink.path, format="parquet").to_table().to_pylist()
    assert sorted(r["n"] for r in rows) == [0, 1, 2, 3]


def test_a_gc_pass_clears_the_folders_the_namespace_lists(redis_server, tmp_path):
    client = redis_server.client()
    ns = f"staging-{os.getpid()}-{time.monotonic_ns()}"
    ks = Keyspace(ns)
    client.hset(ks.meta, mapping={"bucket_ms": 60_000, "horizon_ms": 3_600_000})
    sinks = [ParquetSink(str(tmp_path / name)) for name in ("a", "b")]
    for i, sink in enumerate(sinks):
        sink.prepare("p", streaming=True)
        _stage(sink, i, _records(3, 10 * i), age_s=2 * HOUR)
    note_staging(client, ks, [sinks[0].staging_folder()])
    note_staging(client, ks, [sinks[1].staging_folder()])  # a later run adds, never drops
    note_staging(client, ks, [sinks[0].staging_folder()])

    result = collect(client, ns, staging_age_s=HOUR)
    assert result.removed["staged_files"].keys == 2
    assert _staged(sinks[0].path) == [] and _staged(sinks[1].path) == []
    # the emptied partition folders go on a later pass, once untouched for the age too
    again = collect(client, ns, staging_age_s=0)
    assert "staged_files" not in again.removed
    assert os.listdir(sinks[0].staging_folder()) == []
