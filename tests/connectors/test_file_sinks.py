"""The Parquet sink's transaction on real files, read back with pyarrow.

Each test plays a step of the runtime's delivery protocol (see
``TransactionalWriter``) and then looks at the folder as a reader would: what is visible,
and whether anything an interrupted attempt left can still become visible.
"""

from __future__ import annotations

import os

import pyarrow.dataset as ds
import pytest

from onceflow.connectors.base import DeliveryMark, TaskInfo
from onceflow.connectors.parquet import ID_COLUMN, STAGING, ParquetSink
from onceflow.kernel.records import Record


def _records(n: int, start: int = 0) -> list[Record]:
    return [
        Record(i.to_bytes(16, "big"), 1000 + i, {"n": i, "user": f"u{i % 2}"})
        for i in range(start, start + n)
    ]


def _writer(sink: ParquetSink, attempt: int = 0):
    return sink.open(TaskInfo("p", "files", 3, 1, attempt, exactly_once=True))


def _visible(path: str) -> list[dict]:
    if not any(f.endswith(".parquet") for _d, _s, fs in os.walk(path) for f in fs):
        return []
    table = ds.dataset(path, format="parquet", partitioning="hive").to_table()
    return sorted(table.to_pylist(), key=lambda r: r["n"])


def _staged(path: str) -> list[str]:
    return [f for _d, _s, fs in os.walk(os.path.join(path, STAGING)) for f in fs]


@pytest.fixture
def sink(tmp_path):
    s = ParquetSink(str(tmp_path / "out"), partition_by=["user"])
    s.prepare("p", streaming=True)
    return s


def test_a_committed_delivery_is_visible_once_with_its_ids(sink):
    w = _writer(sink)
    assert w.write(_records(10)) == []
    marker = w.prepare()
    assert _visible(sink.path) == [], "staged files are not visible before the commit"
    w.commit()
    rows = _visible(sink.path)
    assert [r["n"] for r in rows] == list(range(10))
    assert rows[3][ID_COLUMN] == (3).to_bytes(16, "big").hex() and rows[3]["user"] == "u1"
    assert _writer(sink, 1).committed(marker) and _staged(sink.path) == []


def test_a_delivery_prepared_but_not_committed_never_becomes_visible(sink):
    zombie = _writer(sink)
    zombie.write(_records(10))
    marker = zombie.prepare()
    retry = _writer(sink, 1)
    retry.settle([retry.identity])
    assert _staged(sink.path) == [] and not retry.committed(marker)
    with pytest.raises(FileNotFoundError):
        zombie.commit()  # the attempt woke up after the retry settled: its rename fails
    assert _visible(sink.path) == []
    retry.write(_records(10))
    retry.prepare()
    retry.commit()
    assert [r["n"] for r in _visible(sink.path)] == list(range(10))


def test_a_commit_cut_between_two_renames_is_written_again_whole(sink):
    first = _writer(sink)
    first.write(_records(10))
    marker = first.prepare()
    staging, final = first.staged[0]  # the kill came after the first of two renames
    os.makedirs(os.path.dirname(final), exist_ok=True)
    os.replace(staging, final)
    retry = _writer(sink, 1)
    retry.settle([retry.identity])
    assert not retry.committed(marker), "half a delivery is not a committed one"
    assert _visible(sink.path) == [], "the half that was visible is taken back"
    retry.write(_records(10))
    retry.prepare()
    retry.commit()
    assert [r["n"] for r in _visible(sink.path)] == list(range(10))


def test_the_same_records_written_again_keep_their_file_names(sink):
    names = []
    for attempt in range(2):
        w = _writer(sink, attempt)
        w.write(_records(6))
        w.prepare()
        names.append(sorted(os.path.basename(final) for _s, final in w.staged))
        w.commit()
    assert names[0] == names[1]
    assert [r["n"] for r in _visible(sink.path)] == list(range(6)), "replaced, not added"


def test_rows_that_cannot_be_written_are_refused_alone(sink):
    good = _records(4)
    clash = Record(b"c" * 16, 1, {"n": "not a number", "user": "u0"})
    no_column = Record(b"d" * 16, 1, {"n": 99})
    w = _writer(sink)
    refused = w.write([*good[:2], clash, no_column, *good[2:]])
    assert [(r.id, reason.split(":")[0]) for r, reason in refused] == [
        (b"c" * 16, "cannot be a Parquet row"),
        (b"d" * 16, "cannot be a Parquet row"),
    ]
    assert "no column 'user'" in refused[1][1]
    w.prepare()
    w.commit()
    assert [r["n"] for r in _visible(sink.path)] == [0, 1, 2, 3]


def test_a_field_the_first_row_lacks_is_written_not_dropped(sink):
    """Rows of one write that differ in their fields: each keeps all of its own (a later
    row's document was dropped silently: pyarrow takes the columns from the first row)."""
    rows = [
        Record(b"a" * 16, 1, {"n": 0, "user": "u0"}),
        Record(b"b" * 16, 1, {"n": 1, "user": "u0", "body": "a document"}),
    ]
    w = _writer(sink)
    assert w.write(rows) == []
    w.prepare()
    w.commit()
    assert [r.get("body") for r in _visible(sink.path)] == [None, "a document"]


def test_object_store_paths_are_refused_with_the_reason():
    from onceflow.connectors.errors import ConnectorError

    with pytest.raises(ConnectorError, match="atomically"):
        ParquetSink("s3a://bucket/out")


def test_json_lines_in_an_exactly_once_run_are_staged_and_hold_their_ids(tmp_path):
    """The JSON-lines sink takes the same transaction (its own suffix and lines)."""
    import json

    from onceflow.connectors.files import JsonLinesSink

    sink = JsonLinesSink(str(tmp_path / "lines"))
    sink.prepare("p", streaming=True)
    zombie = _writer(sink)
    zombie.write(_records(3))
    marker = zombie.prepare()
    retry = _writer(sink, 1)
    retry.settle([retry.identity])
    assert not retry.committed(marker) and sink.read() == []
    retry.write(_records(3))
    retry.prepare()
    retry.commit()
    lines = sink.read()
    assert [line["value"]["n"] for line in lines] == [0, 1, 2]
    assert lines[0]["id"] == (0).to_bytes(16, "big").hex()
    assert not json.loads(marker)[0].startswith("/"), "markers are relative to the folder"


def test_committed_deliveries_of_a_batch_are_read_back_by_their_marks(sink):
    """A delivery's mark is a file renamed into place after its files (readers skip it): the
    folder alone says which deliveries of a micro-batch committed. One whose rename did not
    happen is not among them; the next batch's commit forgets this batch's."""
    w = _writer(sink)
    for seq, start in enumerate([0, 4]):
        w.write(_records(4, start))
        w.prepare(DeliveryMark("inc1", 3, seq, f"d{seq}"))
        w.commit()
    zombie = _writer(sink, 1)
    zombie.write(_records(4, 8))
    marker = zombie.prepare(DeliveryMark("inc1", 3, 2, "d2"))  # then killed: no rename
    retry = _writer(sink, 2)
    retry.settle([retry.identity])
    assert not retry.committed(marker)
    marks = retry.delivered_in(3, "inc1", None)
    assert [(m.seq, m.digest) for m in marks] == [(0, "d0"), (1, "d1")]
    assert retry.delivered_in(3, "another", None) == []
    assert [r["n"] for r in _visible(sink.path)] == list(range(8)), "marks are not rows"
    later = sink.open(TaskInfo("p", "files", 4, 1, 3, exactly_once=True))
    later.write(_records(2, 20))
    later.prepare(DeliveryMark("inc1", 4, 0, "e0"))
    later.commit()
    assert later.delivered_in(3, "inc1", None) == [], "batch 3's marks are forgotten"
    assert [m.digest for m in later.delivered_in(4, "inc1", None)] == ["e0"]
