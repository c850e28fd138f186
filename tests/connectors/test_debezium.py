"""Debezium's change events as Change records, without a broker: the events below are what
Debezium 3.6.1's PostgreSQL connector wrote through Kafka Connect's JsonConverter (captured
from a run of ``onceflow.testing.kafka_connect``), their schemas cut short."""

from __future__ import annotations

import copy
import json

import pytest

from onceflow import Change
from onceflow.connectors import debezium
from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.kafka.source import KafkaSource
from onceflow.kernel import codec, ids
from onceflow.kernel.records import DeadLetter, Record
from tests.connectors.test_source_decoding import _decode

SOURCE = {
    "version": "3.6.1.Final", "connector": "postgresql", "name": "cdc", "ts_ms": 1795971863405,
    "snapshot": "false", "db": "postgres", "sequence": '[null,"22188464"]',
    "ts_us": 1795971863405709, "ts_ns": 1795971863405709000, "schema": "public",
    "table": "users", "txId": 729, "lsn": 22188464, "xmin": None, "origin": None,
    "origin_lsn": None,
}  # fmt: skip
UPDATE = {
    "before": None,
    "after": {"id": 2, "name": "bb", "score": "2.00"},
    "source": SOURCE,
    "transaction": None,
    "op": "u",
    "ts_ms": 1795971863442,
}
READ = {
    **UPDATE,
    "op": "r",
    "after": {"id": 2, "name": "b", "score": "2.00"},
    "source": {**SOURCE, "snapshot": "last", "lsn": 22188424, "txId": 728},
}
DELETE = {
    **UPDATE,
    "op": "d",
    "before": {"id": 1, "name": None, "score": None},
    "after": None,
    "source": {**SOURCE, "lsn": 22188592, "txId": 730},
}
KEY = {"schema": {"type": "struct", "name": "cdc.public.users.Key"}, "payload": {"id": 2}}


def _bytes(doc, schema=True):
    return json.dumps({"schema": {"type": "struct"}, "payload": doc} if schema else doc).encode()


def _resent(event):
    """The same change as a connector restart re-sends it: its handling time differs."""
    again = copy.deepcopy(event)
    again["ts_ms"] += 5000
    again["source"]["ts_us"] = again["source"].get("ts_us", 0) + 1  # newer versions add clocks
    return again


def test_an_update_is_a_change_with_its_place_in_the_log():
    change = debezium.to_change(KEY, {"schema": {}, "payload": UPDATE})
    assert change == Change(
        "update",
        "public.users",
        {"id": 2},
        None,
        {"id": 2, "name": "bb", "score": "2.00"},
        1795971863405,
        "lsn=22188464,txId=729",
        "729",
    )
    assert change.key_value == 2 and change.row == change.after


def test_a_delete_has_no_row_and_a_two_column_key_is_a_tuple():
    change = debezium.to_change({"a": 1, "b": "x"}, DELETE)
    assert change.op == "delete" and change.row is None and change.key_value == (1, "x")


def test_a_resent_change_has_the_same_id_and_content_another_change_does_not():
    first = debezium.to_change(KEY, UPDATE)
    again = debezium.to_change(KEY, _resent(UPDATE))
    assert debezium.change_id(first) == debezium.change_id(again)
    assert debezium.content_print(first) == debezium.content_print(again)
    later = {**UPDATE, "source": {**SOURCE, "lsn": 22190000, "txId": 731}}
    assert debezium.change_id(debezium.to_change(KEY, later)) != debezium.change_id(first)
    other_key = debezium.to_change({"id": 3}, UPDATE)
    assert debezium.change_id(other_key) != debezium.change_id(first)


def test_a_snapshot_row_read_again_by_a_new_snapshot_is_a_copy_a_changed_row_is_not():
    first = debezium.to_change(KEY, READ)
    again = {**READ, "source": {**READ["source"], "lsn": 22999999, "snapshot": "true"}}
    assert debezium.change_id(debezium.to_change(KEY, again)) == debezium.change_id(first)
    changed = {**again, "after": {"id": 2, "name": "b2", "score": "2.00"}}
    assert debezium.change_id(debezium.to_change(KEY, changed)) != debezium.change_id(first)


@pytest.mark.parametrize(
    ("connector", "fields"),
    [
        ("mysql", {"file": "binlog.000003", "pos": 1056, "row": 2, "gtid": None}),
        ("sqlserver", {"change_lsn": "0:1", "commit_lsn": "0:2", "event_serial_no": 1}),
        ("mongodb", {"ord": 1, "h": None}),
    ],
)
def test_other_connectors_places_identify_their_changes(connector, fields):
    source = {"connector": connector, "name": "x", "ts_ms": 5, "db": "d", "table": "t", **fields}
    event = {"op": "c", "before": None, "after": {"id": 1}, "source": source, "ts_ms": 9}
    first = debezium.change_id(debezium.to_change({"id": 1}, event))
    assert debezium.change_id(debezium.to_change({"id": 1}, _resent(event))) == first
    moved = {**event, "source": {**source, next(iter(fields)): "elsewhere"}}
    assert debezium.change_id(debezium.to_change({"id": 1}, moved)) != first


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ({"id": 2, "name": "bb"}, "not a Debezium change event"),  # ExtractNewRecordState
        ({**UPDATE, "op": "x"}, "unknown Debezium operation"),
        ({**UPDATE, "source": {**SOURCE, "ts_ms": None}}, "without a commit time"),
        ([1, 2], "not a Debezium change event"),
    ],
)
def test_what_is_no_change_event_says_why(value, reason):
    with pytest.raises(ValueError, match=reason):
        debezium.to_change(KEY, value)


def test_the_source_reads_changes_skips_tombstones_and_letters_the_rest():
    rows = [
        (0, 1, _bytes({"id": 2}), _bytes(READ), []),
        (1, 1, _bytes({"id": 2}), _bytes(UPDATE, schema=False), []),
        (2, 1, _bytes({"id": 1}), _bytes(DELETE), []),
        (3, 1, _bytes({"id": 1}), None, []),  # Debezium's tombstone after the delete
        (4, 1, _bytes({"id": 2}), _bytes(_resent(UPDATE)), []),
        (5, 1, b"{}", b'{"id": 2, "name": "flat"}', []),
        (6, 1, None, b"not json", []),
    ]
    items = _decode(rows, format="debezium")
    records = [i for i in items if isinstance(i, Record)]
    letters = [i for i in items if isinstance(i, DeadLetter)]
    assert [r.offset for r in records] == [0, 1, 2, 4]
    assert [r.elem.op for r in records] == ["read", "update", "delete", "update"]
    assert records[1].id == records[3].id == ids.from_user_key(debezium.change_id(records[1].elem))
    assert records[1].fingerprint == records[3].fingerprint, "a copy, not an ID conflict"
    assert records[1].ts == SOURCE["ts_ms"], "event time is the commit time"
    assert [(d.code, d.origin) for d in letters] == [
        ("undecodable", "t:0@5"),
        ("undecodable", "t:0@6"),
    ]
    assert "not a Debezium change event" in letters[0].error


def test_a_users_id_and_timestamp_functions_win():
    rows = [(0, 1, _bytes({"id": 2}), _bytes(UPDATE), [])]
    [record] = _decode(rows, format="debezium", id=lambda c: c.after["name"], timestamp=lambda c: 7)
    assert record.id == ids.from_user_key("bb") and record.ts == 7


def test_a_change_crosses_a_stage_boundary_as_itself():
    change = debezium.to_change(KEY, DELETE)
    assert codec.decode(codec.encode([change, ("k", change)])) == [change, ("k", change)]


def test_format_is_checked():
    with pytest.raises(ConnectorError, match="format must be"):
        KafkaSource("t", bootstrap_servers="x:1", format="canal")
    with pytest.raises(ConnectorError, match="choose one"):
        KafkaSource("t", bootstrap_servers="x:1", format="debezium", envelope=True)
    assert "debezium" in KafkaSource("t", bootstrap_servers="x:1", format="debezium").describe()
