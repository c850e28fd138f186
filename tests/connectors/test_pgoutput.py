"""PostgreSQL's pgoutput messages as changes, read from a real server's replication slot."""

from __future__ import annotations

import uuid

import pytest

from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.pgoutput import Decoder, lsn_text, parse_lsn
from onceflow.connectors.postgres_changes import PostgresChanges, ensure_publication, slot_name
from onceflow.kernel import changes
from onceflow.testing.postgres import PASSWORD


@pytest.fixture
def slot(postgres_server):
    name = f"t_{uuid.uuid4().hex[:8]}"
    with postgres_server.connect() as conn:
        conn.execute(
            f"CREATE TABLE {name} (id int PRIMARY KEY, name text, n numeric, ok bool, "
            "doc jsonb, at timestamptz, score float8)"
        )
        ensure_publication(conn, name, [f"public.{name}"])
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (name,))
    yield name
    with postgres_server.connect() as conn:
        conn.execute("SELECT pg_drop_replication_slot(%s)", (name,))


def _peek(conn, slot):
    rows = conn.execute(
        "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, "
        "'proto_version', '1', 'publication_names', %s)",
        (slot, slot),
    ).fetchall()
    return [bytes(r[0]) for r in rows]


def _commits(conn, slot):
    """The commit LSN of each transaction the slot holds, in order."""
    return [d.txn.commit_lsn for d in _walk(_peek(conn, slot)) if d is not None]


def _walk(messages):
    decoder = Decoder()
    for m in messages:
        decoder.message(m)
        yield decoder if m[:1] == b"B" else None


def test_inserts_updates_deletes_and_types_become_changes(postgres_server, slot):
    with postgres_server.connect() as conn:
        with conn.transaction():
            conn.execute(
                f"INSERT INTO {slot} VALUES (1, 'a', 1.50, true, '{{\"x\": [1]}}', "
                "'2026-11-29 10:00:00+00', 0.5), (2, NULL, NULL, NULL, NULL, NULL, NULL)"
            )
        conn.execute(f"UPDATE {slot} SET name = 'b' WHERE id = 2")
        conn.execute(f"DELETE FROM {slot} WHERE id = 1")
        conn.execute(f"TRUNCATE {slot}")
        found = list(Decoder().changes(iter(_peek(conn, slot)), 0, 2**64))
    assert [(c.op, c.key) for c in found] == [
        ("insert", {"id": 1}),
        ("insert", {"id": 2}),
        ("update", {"id": 2}),
        ("delete", {"id": 1}),
        ("truncate", None),
    ]
    assert found[0].after == {
        "id": 1, "name": "a", "n": "1.50", "ok": True, "doc": {"x": [1]},
        "at": "2026-11-29 10:00:00+00", "score": 0.5,
    }  # fmt: skip
    assert found[1].after["name"] is None and found[2].after["name"] == "b"
    assert found[3].after is None and found[3].before["id"] == 1
    assert found[0].table == f"public.{slot}" and found[4].table == f"public.{slot}"
    assert found[0].transaction == found[1].transaction != found[2].transaction
    positions = [c.position for c in found]
    assert len(set(positions)) == len(positions), "each change has its own place"
    ids = {changes.change_id(c) for c in found}
    assert len(ids) == len(found)


def test_a_range_holds_the_transactions_committed_in_it_and_a_reread_is_the_same(
    postgres_server, slot
):
    with postgres_server.connect() as conn:
        for i in range(6):
            conn.execute(f"INSERT INTO {slot} (id, name) VALUES (%s, 'x')", (i,))
        commits = _commits(conn, slot)
        assert len(commits) == 6
        messages = _peek(conn, slot)
    middle = list(Decoder().changes(iter(messages), commits[2], commits[4]))
    assert [c.key["id"] for c in middle] == [2, 3]
    again = list(Decoder().changes(iter(messages), commits[2], commits[4]))
    assert [changes.change_id(c) for c in again] == [changes.change_id(c) for c in middle]
    parts = [(0, commits[2]), (commits[2], commits[5]), (commits[5], 2**64)]
    split = [c.key["id"] for lo, hi in parts for c in Decoder().changes(iter(messages), lo, hi)]
    assert split == list(range(6)), "ranges cut between transactions lose and repeat nothing"


def test_lsn_text_and_names():
    assert lsn_text(parse_lsn("16/B374D848")) == "16/B374D848"
    assert parse_lsn("0/1") == 1
    assert slot_name("Orders-Copy.v2") == "onceflow_orders_copy_v2"
    assert len(slot_name("x" * 100)) == 63


def test_settings_errors_are_one_line(postgres_server):
    with pytest.raises(ConnectorError, match="at least one table"):
        PostgresChanges([])
    source = PostgresChanges(
        "missing", conninfo=postgres_server.conninfo, connection={"password": PASSWORD}
    )
    with pytest.raises(ConnectorError, match="has no table 'public.missing'"):
        source.prepare("p", streaming=True)
    with pytest.raises(ConnectorError, match="streaming run"):
        source.prepare("p", streaming=False)


def test_a_publication_the_user_cannot_create_is_one_line_saying_what_to_do(postgres_server):
    table = f"t_{uuid.uuid4().hex[:8]}"
    user = f"u_{uuid.uuid4().hex[:8]}"
    with postgres_server.connect() as conn:
        conn.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
        conn.execute(f"CREATE ROLE {user} LOGIN PASSWORD 'pw'")
        conn.execute(f"GRANT SELECT ON {table} TO {user}")
    conninfo = postgres_server.conninfo.replace("user=onceflow", f"user={user}")
    source = PostgresChanges(table, conninfo=conninfo, connection={"password": "pw"})
    with pytest.raises(ConnectorError, match="cannot create the publication .* pass publication="):
        source.prepare("p", streaming=True)
