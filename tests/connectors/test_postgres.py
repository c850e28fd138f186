"""The PostgreSQL sink's transaction against a real server, read back with psycopg.

Each test plays steps of the runtime's delivery protocol (``TransactionalWriter``) and then
reads the table as any client would.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import pytest

from onceflow.connectors.base import DeliveryMark, PoisonInTransaction, TaskInfo
from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.postgres import PostgresSink
from onceflow.kernel.records import Record
from onceflow.testing.postgres import PASSWORD


@pytest.fixture
def table(postgres_server):
    name = f"t_{uuid.uuid4().hex[:8]}"
    with postgres_server.connect() as conn:
        conn.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, user_name text NOT NULL, n int)")
    return name


def _sink(postgres_server, table, **kw):
    sink = PostgresSink(
        table, conninfo=postgres_server.conninfo, connection={"password": PASSWORD}, **kw
    )
    sink.prepare("p", streaming=True)
    return sink


def _rows(n, start=0):
    return [
        Record(i.to_bytes(16, "big"), 0, {"id": i, "user_name": f"u{i % 2}", "n": i})
        for i in range(start, start + n)
    ]


def _writer(sink, attempt=0, partition=0):
    return sink.open(TaskInfo("p", "db", 1, partition, attempt, exactly_once=True))


def _read(postgres_server, table):
    with postgres_server.connect() as conn:
        return conn.execute(f"SELECT id, user_name, n FROM {table} ORDER BY id").fetchall()


def test_rows_and_marker_commit_together(postgres_server, table):
    sink = _sink(postgres_server, table)
    w = _writer(sink)
    assert w.write(_rows(5)) == []
    marker = w.prepare()
    assert _read(postgres_server, table) == [], "not visible before the commit"
    assert not _writer(sink, 1).committed(marker)
    w.commit()
    assert [r[0] for r in _read(postgres_server, table)] == [0, 1, 2, 3, 4]
    assert _writer(sink, 1).committed(marker)
    w.close()


def test_a_paused_attempt_is_ended_before_the_retry_asks(postgres_server, table):
    sink = _sink(postgres_server, table)
    zombie = _writer(sink)
    zombie.write(_rows(5))
    marker = zombie.prepare()  # then it pauses: a GC pause, a frozen VM
    retry = _writer(sink, 1)
    retry.settle([retry.identity])
    assert not retry.committed(marker)
    with pytest.raises(Exception):  # noqa: B017, PT011 - its session was ended under it
        zombie.commit()
    assert _read(postgres_server, table) == []
    retry.write(_rows(5))
    retry.prepare()
    retry.commit()
    assert len(_read(postgres_server, table)) == 5
    retry.close()


def test_settling_one_partition_leaves_the_others_alone(postgres_server, table):
    sink = _sink(postgres_server, table)
    other = _writer(sink, partition=1)
    other.write(_rows(3, start=10))
    other.prepare()
    retry = _writer(sink, 1, partition=0)
    retry.settle([retry.identity])
    other.commit()
    assert [r[0] for r in _read(postgres_server, table)] == [10, 11, 12]
    other.close()


def test_rows_the_table_refuses_come_back_one_by_one(postgres_server, table):
    sink = _sink(postgres_server, table)
    w = _writer(sink)
    null_user = Record(b"x" * 16, 0, {"id": 100, "user_name": None, "n": 1})
    wrong_type = Record(b"y" * 16, 0, {"id": 101, "user_name": "u", "n": "many"})
    no_column = Record(b"z" * 16, 0, {"id": 102, "colour": "red"})
    # a column the table lacks, a value its column cannot take: refused before anything is sent
    assert [r[0].id for r in w.write([*_rows(2), no_column, wrong_type])] == [b"z" * 16, b"y" * 16]
    w.write([null_user])  # the server refuses it (NOT NULL): found one by one
    with pytest.raises(PoisonInTransaction) as poison:
        w.prepare()
    assert sorted(r.id for r, _why in poison.value.rejected) == [b"x" * 16]
    assert "refused the row" in poison.value.rejected[0][1]
    w.write(_rows(2))  # the runtime sends the rest again
    w.prepare()
    w.commit()
    assert [r[0] for r in _read(postgres_server, table)] == [0, 1]
    w.close()


@dataclass
class Total:
    id: int
    user_name: str
    n: int


def test_upserts_keep_the_last_row_per_key(postgres_server, table):
    sink = _sink(postgres_server, table, mode="upsert", key_columns=["id"])
    w = _writer(sink)
    w.write([Record(b"a" * 16, 0, Total(1, "u1", n)) for n in (1, 2, 3)])
    w.prepare()
    w.commit()
    w.write([Record(b"b" * 16, 0, Total(1, "u1", 7))])
    w.prepare()
    w.commit()
    assert _read(postgres_server, table) == [(1, "u1", 7)]
    w.close()


def test_settings_errors_are_one_line_without_the_password(postgres_server, table):
    with pytest.raises(ConnectorError, match="needs key_columns"):
        PostgresSink(table, mode="upsert")
    with pytest.raises(ConnectorError, match="has no table 'missing'"):
        _sink(postgres_server, "missing")
    bad = PostgresSink(table, conninfo=postgres_server.conninfo, connection={"password": "nope"})
    with pytest.raises(ConnectorError, match="cannot connect to PostgreSQL") as err:
        bad.prepare("p", streaming=True)
    assert "nope" not in str(err.value) and PASSWORD not in str(err.value)


def test_the_delivery_table_keeps_one_marker_per_partition(postgres_server, table):
    sink = _sink(postgres_server, table)
    sink_name = f"db-{table}"  # markers of this test's own sink only
    first = sink.open(TaskInfo("p", sink_name, 1, 1, 0, exactly_once=True))
    other = sink.open(TaskInfo("p", sink_name, 1, 11, 0, exactly_once=True))
    for writer, start in ((first, 0), (other, 100)):
        writer.write(_rows(2, start))
        writer.prepare()
        writer.commit()
    retry = sink.open(TaskInfo("p", sink_name, 2, 1, 1, exactly_once=True))
    markers = []
    for start in (10, 20, 30):
        retry.write(_rows(2, start))
        markers.append(retry.prepare())
        retry.commit()
    with postgres_server.connect() as conn:
        left = [
            m
            for (m,) in conn.execute("SELECT marker FROM onceflow_deliveries").fetchall()
            if m.startswith(f"p/{sink_name}/")
        ]
    assert sorted(left) == sorted([markers[-1], f"p/{sink_name}/11/{other.token}/0"])
    assert retry.committed(markers[-1]), "the last delivery is still answered"
    assert len(_read(postgres_server, table)) == 10


def test_committed_deliveries_of_a_batch_are_read_back_by_their_marks(postgres_server, table):
    """A delivery's mark lies in its marker row: the sink alone says which deliveries of a
    micro-batch committed (what the runtime asks when Redis lost their records). An aborted
    one is not there; another batch's are deleted by the next batch's first delivery."""
    sink = _sink(postgres_server, table)
    w = _writer(sink)
    for seq, rows in enumerate([_rows(2), _rows(2, 2)]):
        w.write(rows)
        w.prepare(DeliveryMark("inc1", 1, seq, f"d{seq}"))
        w.commit()
    w.write(_rows(2, 4))
    w.prepare(DeliveryMark("inc1", 1, 2, "d2"))
    w.abort()  # never committed
    marks = _writer(sink, 1).delivered_in(1, "inc1", None)
    assert [(m.seq, m.digest) for m in marks] == [(0, "d0"), (1, "d1")]
    assert _writer(sink, 1).delivered_in(1, "another", None) == [], "another reset's"
    later = sink.open(TaskInfo("p", "db", 2, 0, 2, exactly_once=True))
    later.write(_rows(2, 6))
    later.prepare(DeliveryMark("inc1", 2, 0, "e0"))
    later.commit()
    assert _writer(sink, 3).delivered_in(1, "inc1", None) == [], "batch 1's rows are gone"
    assert [m.digest for m in _writer(sink, 3).delivered_in(2, "inc1", None)] == ["e0"]
    w.close()
    later.close()


def test_an_upsert_without_a_unique_constraint_on_its_keys_is_refused_before_the_run(
    postgres_server, table
):
    # every row would be refused by the server (no ON CONFLICT target): issue 42 saw all rows
    # go to dead letters and the run exit 0
    with pytest.raises(ConnectorError) as err:
        _sink(postgres_server, table, mode="upsert", key_columns=["user_name"])
    line = str(err.value)
    assert "needs a unique constraint on exactly (user_name)" in line
    assert "which has: (id)" in line and "ADD PRIMARY KEY (user_name)" in line
    assert "\n" not in line
    _sink(postgres_server, table, mode="upsert", key_columns=["id"])  # the primary key will do


def test_an_error_that_is_no_rows_fault_fails_the_task_instead_of_every_row(postgres_server, table):
    sink = _sink(postgres_server, table)
    with postgres_server.connect() as conn:
        conn.execute(f"ALTER TABLE {table} DROP COLUMN n")  # changed under the run
    w = _writer(sink)
    w.write(_rows(3))
    with pytest.raises(ConnectorError, match=r'failed: column "n" of relation .* does not exist'):
        w.prepare()
    w.abort()


def test_values_are_fitted_to_their_columns_types_and_unfit_ones_are_dead_letters(
    postgres_server,
):
    from datetime import UTC, date, datetime

    name = f"t_{uuid.uuid4().hex[:8]}"
    with postgres_server.connect() as conn:
        conn.execute(
            f"CREATE TABLE {name} (id int PRIMARY KEY, at timestamptz, local timestamp, "
            "day date, doc jsonb, n bigint)"
        )
    sink = _sink(postgres_server, name)
    w = _writer(sink)
    at = datetime(2026, 3, 1, 12, 30, tzinfo=UTC)
    good = [
        Record(b"a" * 16, 0, {"id": 1, "at": at, "local": at.replace(tzinfo=None), "day": at}),
        Record(b"b" * 16, 0, {"id": 2, "at": 1_772_368_200_000, "doc": {"tags": ["x"]}}),
        Record(b"c" * 16, 0, {"id": 3, "at": "2026-03-01T12:30:00Z", "day": date(2026, 3, 1)}),
    ]
    unfit = Record(b"d" * 16, 0, {"id": 4, "n": "many"})
    nested = Record(b"e" * 16, 0, {"id": 5, "n": [1, 2]})
    rejected = w.write([*good, unfit, nested])
    assert [(r.id, why) for r, why in rejected] == [
        (b"d" * 16, f"cannot be a row of {name}: column 'n' is int8: expected an int, got 'many'"),
        (
            b"e" * 16,
            f"cannot be a row of {name}: column 'n' is int8: expected a value, not a list or "
            "dict (those fit json columns), got [1, 2]",
        ),
    ]
    w.prepare()
    w.commit()
    w.close()
    with postgres_server.connect() as conn:
        rows = conn.execute(f"SELECT id, at, local, day, doc FROM {name} ORDER BY id").fetchall()
    assert [r[1] for r in rows] == [at, at, at]
    assert rows[0][2] == at.replace(tzinfo=None) and rows[0][3] == date(2026, 3, 1)
    assert rows[1][4] == {"tags": ["x"]} and rows[2][3] == date(2026, 3, 1)


@pytest.mark.spark
def test_a_pipeline_upserting_into_a_table_without_the_constraint_does_not_start(
    spark, postgres_server, table, tmp_path
):
    from onceflow import Pipeline, sources

    p = Pipeline("pg-misconfigured")
    rows = [{"id": i, "user_name": f"u{i % 2}", "n": i} for i in range(4)]
    p.read("rows", sources.Collection(rows)).write(
        "db",
        PostgresSink(
            table,
            conninfo=postgres_server.conninfo,
            connection={"password": PASSWORD},
            mode="upsert",
            key_columns=["user_name"],
        ),
    )
    with pytest.raises(ConnectorError, match=r"needs a unique constraint on exactly \(user_name\)"):
        p.run(session=spark, output_dir=str(tmp_path), progress=False)
    assert _read(postgres_server, table) == []


def test_a_keyed_streams_key_fills_the_key_columns_the_row_lacks(postgres_server, table):
    sink = _sink(postgres_server, table, mode="upsert", key_columns=["id"])
    w = sink.open(TaskInfo("p", "db", 1, 0, 0, exactly_once=True, keyed=True))
    rows = [(1, {"user_name": "u1", "n": 5}), (2, {"id": 2, "user_name": "u2", "n": 6})]
    assert w.write([Record(bytes([i]) * 16, 0, r) for i, r in enumerate(rows)]) == []
    w.prepare()
    w.commit()
    assert _read(postgres_server, table) == [(1, "u1", 5), (2, "u2", 6)]
    w.close()
