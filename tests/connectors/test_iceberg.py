"""The Iceberg sink's delivery protocol on a real pyiceberg SQL catalog (SQLite + a folder).

Each test plays steps of the runtime's delivery protocol (``TransactionalWriter``) and then
reads the table with pyiceberg's own scan, as any reader would.
"""

from __future__ import annotations

import json
import os
import threading

import pyarrow as pa
import pytest

pytest.importorskip("pyiceberg")

from onceflow.connectors.base import DeliveryMark, TaskInfo, TransactionBroken
from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.iceberg import IcebergSink
from onceflow.connectors.iceberg_snapshots import DELIVERY, VOID
from onceflow.kernel.records import Record
from onceflow.sinks import Iceberg


def catalog_props(tmp_path):
    warehouse = tmp_path / "warehouse"
    warehouse.mkdir(exist_ok=True)
    return {
        "type": "sql",
        "uri": f"sqlite:///{tmp_path}/catalog.db",
        "warehouse": f"file://{warehouse}",
    }


@pytest.fixture
def sink(tmp_path):
    s = Iceberg("db.events", catalog=catalog_props(tmp_path))
    s.prepare("p", streaming=True)
    return s


def _rows(n, start=0):
    return [
        Record(i.to_bytes(16, "big"), 0, {"id": i, "user": f"u{i % 2}", "n": i * 10})
        for i in range(start, start + n)
    ]


def _writer(sink, attempt=0, partition=0, batch=1):
    return sink.open(TaskInfo("p", "ice", batch, partition, attempt, exactly_once=True))


def _table(sink):
    return sink.load_catalog().load_table(sink.table)


def _read(sink):
    """The rows' ids as pyiceberg's scan sees them (sorted)."""
    return sorted(_table(sink).scan().to_arrow().column("id").to_pylist())


def _data_files(tmp_path):
    return [f for d, _s, fs in os.walk(tmp_path / "warehouse") for f in fs if f.endswith("parquet")]


def test_files_are_invisible_until_the_commit_and_the_marker_tells(sink):
    w = _writer(sink)
    assert w.write(_rows(5)) == []
    marker = w.prepare()
    assert _read(sink) == [], "the data files are referenced by no snapshot yet"
    w.commit()
    assert _read(sink) == [0, 1, 2, 3, 4]
    assert _writer(sink, 1).committed(marker), "a replay finds the marker: nothing again"
    summary = _table(sink).current_snapshot().summary.additional_properties
    assert summary[DELIVERY] == json.loads(marker)["delivery"]
    w.close()


def test_a_replayed_commit_is_a_no_op(sink):
    w = _writer(sink)
    w.write(_rows(3))
    w.prepare()
    files = list(w.files)
    w.commit()
    w.files = files  # the same delivery committed again (a replay after a lost answer)
    w.commit()
    assert _read(sink) == [0, 1, 2]
    assert len(_table(sink).metadata.snapshots) == 2, "the base snapshot and one delivery"


def test_cut_between_data_files_and_commit_leaves_orphans_only(sink, tmp_path):
    zombie = _writer(sink)
    zombie.write(_rows(4))
    marker = zombie.prepare()  # data files written, then kill -9: no commit
    assert _data_files(tmp_path), "the delivery's data files are on disk"
    retry = _writer(sink, 1)
    retry.settle([retry.identity])
    assert not retry.committed(marker)
    assert _read(sink) == [], "orphan files are invisible"
    retry.write(_rows(4))
    retry.prepare()
    retry.commit()
    assert _read(sink) == [0, 1, 2, 3]
    with pytest.raises(TransactionBroken):  # the paused attempt wakes up: its delivery is void
        zombie.commit()
    assert _read(sink) == [0, 1, 2, 3], "the late attempt appended nothing"


def test_the_zombie_that_wins_the_race_is_found_by_the_retry(sink):
    zombie = _writer(sink)
    zombie.write(_rows(4))
    marker = zombie.prepare()
    zombie.commit()  # commits, then is killed before Onceflow marks the delivery done
    retry = _writer(sink, 1)
    assert retry.committed(marker), "the retry finds the winner's marker"
    assert _read(sink) == [0, 1, 2, 3]
    voids = [s for s in _table(sink).metadata.snapshots if VOID in s.summary.additional_properties]
    assert voids == []


class CutBeforeSwap:
    """A catalog that runs ``before`` once, between a writer's look and its compare-and-swap."""

    def __init__(self, catalog, before):
        self.catalog = catalog
        self.before = before

    def commit_table(self, table, requirements, updates):
        if self.before is not None:
            before, self.before = self.before, None
            before()
        return self.catalog.commit_table(table, requirements, updates)

    def __getattr__(self, name):
        return getattr(self.catalog, name)


def _cut(writer, before):
    table = writer.table()
    table.catalog = CutBeforeSwap(table.catalog, before)


def test_the_late_attempt_that_loses_the_race_finds_the_void(sink):
    """The zombie looked (no marker), then the retry voids it, then the zombie's swap: lost."""
    zombie = _writer(sink)
    zombie.write(_rows(6))
    marker = zombie.prepare()
    retry = _writer(sink, 1)
    answers = []
    _cut(zombie, lambda: answers.append(retry.committed(marker)))
    with pytest.raises(TransactionBroken):
        zombie.commit()
    assert answers == [False]
    assert _read(sink) == [], "the zombie appended nothing after its delivery was voided"
    retry.write(_rows(6))
    retry.prepare()
    retry.commit()
    assert _read(sink) == list(range(6))


def test_the_retry_that_loses_the_race_finds_the_delivery(sink):
    """The retry looked (no marker), then the zombie commits, then the retry's void: lost."""
    zombie = _writer(sink)
    zombie.write(_rows(6))
    marker = zombie.prepare()
    retry = _writer(sink, 1)
    _cut(retry, zombie.commit)
    assert retry.committed(marker), "the retry finds the winner's marker, voids nothing"
    assert _read(sink) == list(range(6))
    props = [s.summary.additional_properties for s in _table(sink).metadata.snapshots]
    assert not [p for p in props if VOID in p]


class LostAnswer(CutBeforeSwap):
    """A catalog whose answer to a commit is lost (after it landed, or before it was sent)."""

    def __init__(self, catalog, landed):
        super().__init__(catalog, None)
        self.landed = landed

    def commit_table(self, table, requirements, updates):
        if self.landed:
            self.catalog.commit_table(table, requirements, updates)
        raise OSError("connection reset")


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "lost"])
def test_a_commit_of_unknown_outcome_is_recovered(sink, landed):
    w = _writer(sink)
    w.write(_rows(3))
    w.prepare()
    catalog = w.table().catalog
    w.table().catalog = LostAnswer(catalog, landed)
    with pytest.raises(TransactionBroken):
        w.commit()
    w.table().catalog = catalog
    assert w.recover() == landed
    assert _read(sink) == ([0, 1, 2] if landed else [])


def test_partitions_committing_at_once_all_land(sink):
    writers = [_writer(sink, partition=p) for p in range(4)]
    for p, w in enumerate(writers):
        w.write(_rows(5, start=p * 5))
        w.prepare()
    threads = [threading.Thread(target=w.commit) for w in writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert _read(sink) == list(range(20))


def test_rows_the_schema_cannot_take_become_dead_letters(sink):
    w = _writer(sink)
    w.write(_rows(2))
    w.prepare()
    w.commit()  # the table now has id: int64, user: string, n: int64
    extra = Record(b"d" * 16, 0, {"id": 5, "user": "u", "colour": "red"})
    assert [r.id for r, _why in w.write([extra])] == [b"d" * 16], "not dropped silently"
    bad = [
        Record(b"a" * 16, 0, {"id": 100, "user": "u", "n": "many"}),
        Record(b"b" * 16, 0, {"id": 101, "colour": "red"}),
        Record(b"c" * 16, 0, "not a row"),
    ]
    rejected = w.write([*_rows(2, start=10), *bad])
    assert sorted(r.id for r, _why in rejected) == [b"a" * 16, b"b" * 16, b"c" * 16]
    reasons = {r.id: why for r, why in rejected}
    assert "no column(s) 'colour'" in reasons[b"b" * 16]
    assert reasons[b"a" * 16].startswith("cannot be a row of db.events")
    w.prepare()
    w.commit()
    assert _read(sink) == [0, 1, 10, 11]


def test_rows_that_clash_in_the_first_delivery_still_make_a_table(tmp_path):
    sink = IcebergSink("db.new", catalog=catalog_props(tmp_path))
    w = _writer(sink)
    clash = Record(b"e" * 16, 0, {"id": 9, "user": "u", "n": "many"})
    rejected = w.write([*_rows(3), clash])  # n: numbers, and once text
    w.prepare()
    w.commit()
    assert len(rejected) + len(_read(sink)) == 4, "every row written or a dead letter"
    assert _read(sink)[:3] == [0, 1, 2]


def test_bounded_runs_append_at_flush(sink):
    w = sink.open(TaskInfo("p", "ice", 0, 0, 0, exactly_once=False))
    w.write(_rows(3))
    w.close()
    assert _read(sink) == [0, 1, 2]


def test_a_table_is_created_from_an_explicit_schema_with_partitions(tmp_path):
    schema = pa.schema(
        [pa.field("id", pa.int64(), nullable=False), ("user", pa.string()), ("n", pa.int32())]
    )
    sink = IcebergSink(
        "db.typed", catalog=catalog_props(tmp_path), schema=schema, partition_by=["user"]
    )
    sink.prepare("p", streaming=True)
    table = _table(sink)
    assert [f.name for f in table.schema().fields] == ["id", "user", "n"]
    assert [f.name for f in table.spec().fields] == ["user"]
    w = _writer(sink)
    no_id = Record(b"f" * 16, 0, {"user": "u", "n": 1})
    rejected = w.write([*_rows(4), no_id])
    assert [(r.id, "required column(s) 'id' missing" in why) for r, why in rejected] == [
        (b"f" * 16, True)
    ]
    w.prepare()
    w.commit()
    assert _read(sink) == [0, 1, 2, 3]


def test_expired_history_is_not_taken_for_not_delivered(sink):
    w = _writer(sink)
    w.write(_rows(2))
    marker = w.prepare()
    w.commit()
    for start in (10, 20):
        more = _writer(sink, partition=1)
        more.write(_rows(1, start=start))
        more.prepare()
        more.commit()
    table = _table(sink)
    keep = table.current_snapshot().snapshot_id
    old = [s.snapshot_id for s in table.metadata.snapshots if s.snapshot_id != keep]
    table.maintenance.expire_snapshots().by_ids(old).commit()
    with pytest.raises(ConnectorError, match="cannot tell whether delivery"):
        _writer(sink, 1).committed(marker)


def test_catalog_errors_are_one_line_without_the_credentials(tmp_path):
    bad = IcebergSink(
        "db.events",
        catalog={"type": "sql", "uri": "postgresql+psycopg://u:s3cr3t@127.0.0.1:1/x"},
        catalog_name="bad",
    )
    assert "s3cr3t" not in bad.describe()
    with pytest.raises(ConnectorError) as err:
        bad.prepare("p", streaming=True)
    assert "s3cr3t" not in str(err.value)
    assert "\n" not in str(err.value)


def test_committed_deliveries_of_a_batch_are_read_back_by_their_marks(sink):
    """A delivery's mark lies in its snapshot's ``onceflow.delivery``: the table alone says
    which deliveries of a micro-batch committed. A voided one is not among them."""
    w = _writer(sink)
    for seq, start in enumerate([0, 3]):
        w.write(_rows(3, start))
        w.prepare(DeliveryMark("inc1", 1, seq, f"d{seq}"))
        w.commit()
    zombie = _writer(sink, 1)
    zombie.write(_rows(3, 6))
    marker = zombie.prepare(DeliveryMark("inc1", 1, 2, "d2"))
    assert not _writer(sink, 2).committed(marker), "voided: it never commits"
    marks = _writer(sink, 3).delivered_in(1, "inc1", None)
    assert [(m.seq, m.digest) for m in marks] == [(0, "d0"), (1, "d1")]
    assert _writer(sink, 3).delivered_in(2, "inc1", None) == []
    assert _writer(sink, 3).delivered_in(1, "another", None) == []


def test_tasks_racing_to_create_the_namespace_all_get_the_table(tmp_path):
    """A SQL catalog's loser of the race fails on its unique key (IntegrityError, seen in CI
    as a stopped run); every task's writer must still get the table."""
    schema = pa.schema([("k", pa.string()), ("n", pa.int64())])
    gate = threading.Barrier(6)
    failures: list[BaseException] = []
    # the driver's prepare opened the catalog (its tables made) and found no table to create
    Iceberg("racing.events", catalog=catalog_props(tmp_path)).load_catalog()

    def create(i: int) -> None:
        # one catalog connection per task, as in a run's separate processes (the sink caches
        # one per process and configuration: the extra property makes each its own)
        props = {**catalog_props(tmp_path), "onceflow.test.task": str(i)}
        s = Iceberg("racing.events", catalog=props, schema=schema)
        gate.wait()
        try:
            assert s.load_table() is not None
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion below
            failures.append(exc)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
