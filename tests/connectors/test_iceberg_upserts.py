"""The Iceberg sink's upserts and deletes (``mode="upsert"``) on a real pyiceberg SQL catalog.

A keyed stream's ``(key, row)`` replaces the row its key names, ``(key, None)`` deletes it; each
delivery is one snapshot that does both and names the delivery, so the delivery protocol
(looking for the marker, the void, the compare-and-swap on the head) holds as for appends.
Each test plays the runtime's steps and reads the table with pyiceberg's own scan.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pyiceberg")

from onceflow.connectors.base import TaskInfo, TransactionBroken
from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.iceberg import IcebergSink
from onceflow.connectors.iceberg_snapshots import DELIVERY, VOID
from onceflow.kernel.records import Record
from tests.connectors.test_iceberg import LostAnswer, _cut, _data_files, catalog_props

_ids = iter(range(1, 1 << 62))


def _sink(tmp_path, **kwargs):
    s = IcebergSink(
        "db.users",
        catalog=catalog_props(tmp_path),
        mode="upsert",
        key_columns=kwargs.pop("key_columns", ["id"]),
        **kwargs,
    )
    s.prepare("p", streaming=True)
    return s


@pytest.fixture
def sink(tmp_path):
    return _sink(tmp_path)


def _writer(sink, attempt=0, partition=0, batch=1, keyed=True):
    task = TaskInfo("p", "ice", batch, partition, attempt, exactly_once=True, keyed=keyed)
    return sink.open(task)


def _changes(*changes):
    """Records of a keyed stream: (id, n) sets the user's row, (id, None) deletes it."""
    return [
        Record(next(_ids).to_bytes(16, "big"), 0, (i, None if n is None else {"n": n}))
        for i, n in changes
    ]


def _deliver(writer, *changes):
    assert writer.write(_changes(*changes)) == []
    marker = writer.prepare()
    writer.commit()
    return marker


def _table(sink):
    return sink.load_catalog().load_table(sink.table)


def _read(sink, *columns):
    """The table's rows as pyiceberg's scan sees them: {key: n} (sorted by key)."""
    rows = _table(sink).scan().to_arrow().to_pylist()
    keys = [tuple(r[c] for c in columns) if columns else r["id"] for r in rows]
    assert len(set(keys)) == len(keys), f"a key has more than one row: {sorted(keys)}"
    return dict(sorted(zip(keys, (r["n"] for r in rows), strict=True)))


def _summaries(sink):
    return [s.summary for s in _table(sink).metadata.snapshots]


def test_an_upsert_replaces_the_keys_rows_and_a_none_deletes_them(sink):
    w = _writer(sink)
    _deliver(w, (0, 0), (1, 10), (2, 20), (3, 30))
    assert _read(sink) == {0: 0, 1: 10, 2: 20, 3: 30}
    marker = _deliver(w, (1, 11), (3, None), (7, 70), (8, None))
    assert _read(sink) == {0: 0, 1: 11, 2: 20, 7: 70}, "8 was never there: deleting it is no fault"
    last = _summaries(sink)[-1]
    assert last.additional_properties[DELIVERY] == json.loads(marker)["delivery"]
    assert last.operation.value == "overwrite", "one snapshot removes and adds"
    assert len(_summaries(sink)) == 3, "the base snapshot and one per delivery"


def test_the_last_change_of_a_key_in_a_delivery_wins(sink):
    w = _writer(sink)
    _deliver(w, (1, 1), (2, 2), (3, 3), (4, 4))
    w.write(_changes((1, 100), (1, None), (2, None), (3, None)))
    w.write(_changes((1, 101), (2, 200), (2, None), (3, 300), (4, 400), (4, 401), (5, None)))
    w.write(_changes((5, 500), (6, None), (6, 600), (6, None), (6, 601)))
    w.prepare()
    w.commit()
    assert _read(sink) == {1: 101, 3: 300, 4: 401, 5: 500, 6: 601}


def test_a_retry_after_a_landed_commit_applies_nothing_again(sink):
    """Delivery A sets 1 and deletes 2, and lands; B sets 1 again and 2 anew; the retry of A
    (its answer lost) must find A's marker: applying A again would undo B."""
    _deliver(_writer(sink, partition=1), (1, 0), (2, 0))
    zombie = _writer(sink)
    zombie.write(_changes((1, 10), (2, None)))
    marker = zombie.prepare()
    prepared = (list(zombie.files), zombie.removing)
    zombie.commit()  # lands, then the task dies before Onceflow marks the delivery done
    _deliver(_writer(sink, partition=1, batch=2), (1, 20), (2, 20))
    retry = _writer(sink, 1)
    assert retry.committed(marker), "the retry finds A's snapshot"
    zombie.files, zombie.removing = prepared  # A's commit replayed as it was
    zombie.commit()
    assert _read(sink) == {1: 20, 2: 20}, "A applied once, before B"
    assert not [s for s in _summaries(sink) if VOID in s.additional_properties]


def test_a_voided_upsert_never_applies(sink):
    _deliver(_writer(sink, partition=1), (1, 0), (2, 0))
    zombie = _writer(sink)
    zombie.write(_changes((1, 10), (2, None), (3, 30)))
    marker = zombie.prepare()  # paused here, not dead
    retry = _writer(sink, 1)
    assert not retry.committed(marker), "voided: it never commits"
    with pytest.raises(TransactionBroken):
        zombie.commit()
    assert _read(sink) == {1: 0, 2: 0}, "the late attempt removed and added nothing"
    _deliver(retry, (1, 10), (2, None), (3, 30))
    assert _read(sink) == {1: 10, 3: 30}


def test_the_late_upsert_that_loses_the_race_finds_the_void(sink):
    """The zombie looked (no marker) and found the files to rewrite; the retry voids it before
    the zombie's swap: lost, nothing of it lands."""
    _deliver(_writer(sink, partition=1), (1, 0))
    zombie = _writer(sink)
    zombie.write(_changes((1, None)))
    marker = zombie.prepare()
    retry = _writer(sink, 1)
    answers = []
    _cut(zombie, lambda: answers.append(retry.committed(marker)))
    with pytest.raises(TransactionBroken):
        zombie.commit()
    assert answers == [False]
    assert _read(sink) == {1: 0}


def test_a_commit_that_lost_the_head_rewrites_again_on_the_new_one(sink, tmp_path):
    """Another partition's commit lands between a delivery's rewrite and its swap: the swap
    fails, the rewrite is found again on the new head (its key's new row removed too), and the
    files of the lost try are deleted."""
    _deliver(_writer(sink, partition=1), (1, 0), (2, 0))
    w = _writer(sink)
    w.write(_changes((1, 10)))
    w.prepare()
    other = _writer(sink, partition=1, batch=2)
    _cut(w, lambda: _deliver(other, (1, 99), (2, 22)))
    w.commit()
    assert _read(sink) == {1: 10, 2: 22}
    table = _table(sink)
    live = {t.file.file_path.rsplit("/", 1)[-1] for t in table.scan().plan_files()}
    written = set(_data_files(tmp_path))
    committed = set()
    for snapshot in table.metadata.snapshots:
        for manifest in snapshot.manifests(table.io):
            for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=False):
                committed.add(entry.data_file.file_path.rsplit("/", 1)[-1])
    assert live <= committed
    assert written == committed, "a data file of the lost try is left behind"


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "lost"])
def test_an_upsert_of_unknown_outcome_is_recovered(sink, landed):
    _deliver(_writer(sink, partition=1), (1, 0), (2, 0))
    w = _writer(sink)
    w.write(_changes((1, 10), (2, None)))
    w.prepare()
    catalog = w.table().catalog
    w.table().catalog = LostAnswer(catalog, landed)
    with pytest.raises(TransactionBroken):
        w.commit()
    w.table().catalog = catalog
    assert w.recover() == landed
    assert _read(sink) == ({1: 10} if landed else {1: 0, 2: 0})


def test_keys_of_several_columns_and_a_key_that_moves_partitions(tmp_path):
    sink = _sink(tmp_path, key_columns=["region", "id"], partition_by=["region"])
    w = _writer(sink, keyed=False)

    def rows(*changes):
        return [
            Record(next(_ids).to_bytes(16, "big"), 0, {"region": r, "id": i, "n": n, "home": h})
            for r, i, n, h in changes
        ]

    assert w.write(rows(("eu", 1, 1, "a"), ("us", 1, 2, "a"), ("eu", 2, 3, "a"))) == []
    w.prepare()
    w.commit()
    assert w.write(rows(("us", 1, 20, "b"), ("eu", 2, 30, "b"))) == []
    w.prepare()
    w.commit()
    assert _read(sink, "region", "id") == {("eu", 1): 1, ("eu", 2): 30, ("us", 1): 20}
    keyed = _writer(sink, partition=1)
    keyed.write([Record(b"k" * 16, 0, (("eu", 1), None))])
    keyed.prepare()
    keyed.commit()
    assert _read(sink, "region", "id") == {("eu", 2): 30, ("us", 1): 20}


def test_bad_changes_are_dead_letters_and_deletes_before_the_table_delete_nothing(tmp_path):
    sink = _sink(tmp_path, key_columns=["region", "id"])
    w = _writer(sink)
    deletes = [Record(b"d" * 16, 0, (("eu", 1), None))]
    assert w.write(deletes) == [], "no table yet: nothing to delete, nothing refused"
    bad = [
        Record(b"a" * 16, 0, (("eu",), None)),  # a key that names one of two key columns
        Record(b"b" * 16, 0, ("eu", {"region": "eu", "n": 1})),  # ... and a row without id
        Record(b"c" * 16, 0, (("eu", None), {"n": 1})),
    ]
    good = [Record(b"g" * 16, 0, (("eu", 1), {"n": 1}))]
    reasons = {r.id: why for r, why in w.write([*bad, *good])}
    assert sorted(reasons) == [b"a" * 16, b"b" * 16, b"c" * 16]
    assert "does not name the row's key_columns" in reasons[b"a" * 16]
    assert "key column(s) 'id' missing" in reasons[b"b" * 16]
    w.prepare()
    w.commit()
    assert _read(sink, "region", "id") == {("eu", 1): 1}


def test_upsert_needs_key_columns_the_table_has(tmp_path):
    with pytest.raises(ConnectorError, match="needs key_columns"):
        IcebergSink("db.t", mode="upsert")
    with pytest.raises(ConnectorError, match="mode must be one of append, upsert"):
        IcebergSink("db.t", mode="merge", key_columns=["id"])
    _deliver(_writer(_sink(tmp_path)), (1, 1))
    with pytest.raises(ConnectorError, match="has no key column"):
        _sink(tmp_path, key_columns=["user_id"])


def test_a_bounded_upsert_run_twice_leaves_one_row_per_key(sink):
    for _run in range(2):
        w = sink.open(TaskInfo("p", "ice", 0, 0, 0, exactly_once=False, keyed=True))
        w.write(_changes((1, 1), (2, 2), (2, None), (3, 3)))
        w.close()
    assert _read(sink) == {1: 1, 3: 3}


def test_manifests_of_only_deleted_files_are_not_carried_along(sink):
    """Every upsert deletes; a manifest whose files were all deleted lists nothing a scan reads,
    and carried into every later snapshot it would make each commit read more (pyiceberg keeps
    them; Iceberg's Java writer drops them, and so does the sink)."""
    w = _writer(sink)
    for n in range(20):
        _deliver(w, (1, n), (2, n), (3, None if n % 2 else n))
    assert _read(sink) == {1: 19, 2: 19}
    table = _table(sink)
    assert len(table.current_snapshot().manifests(table.io)) <= 3
