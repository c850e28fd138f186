"""The source's hot path (a lane's records decoded as columns) says what the record-by-record
path says, record for record and letter for letter, whatever the input.

Random slices of raw Kafka records (good, bad and missing values; ID and timestamp headers,
good and bad; gap markers, replayed dead letters and other headers; ID and timestamp
functions that work, fail or return None) are decoded by the source's decoder and, as a
reference, by :func:`onceflow.connectors.kafka.decode._decode_one` one record at a time.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onceflow.connectors.decoded import RecordColumns
from onceflow.connectors.kafka.decode import _decode_one
from onceflow.connectors.kafka.offsets import tp_key
from onceflow.connectors.kafka.source import KafkaSource
from onceflow.connectors.kafka.worker import RAW_COLUMNS, pack_headers
from onceflow.kernel import ids
from onceflow.kernel.codec import value_codec

GOOD_VALUES = [b'{"id": "a", "ts": 5}', b'{"id": 7, "ts": 9}', b'{"id": "a"}', b"[1, 2]", b"3"]
BAD_VALUES = [b"{not json", b"\xff\xfe"]
HEADERS = {
    "none": [],
    "id-text": [(ids.ID_HEADER, b"event-1")],
    "id-uuid": [(ids.ID_HEADER, str(uuid.UUID(int=5)).encode())],
    "id-16": [(ids.ID_HEADER, b"0123456789abcdef")],
    "id-empty": [(ids.ID_HEADER, b"")],
    "ts": [(ids.TS_HEADER, b"1234")],
    "ts-bad": [(ids.TS_HEADER, b"x1")],
    "id-ts": [(ids.ID_HEADER, b"e"), (ids.TS_HEADER, b"77")],
    "gap": [(ids.GAP_HEADER, b"3-9")],
    "other": [("trace", b"abc")],
}


def _id_fn(kind: str) -> Any:
    if kind == "field":
        return lambda e: e["id"]  # fails on values that are not objects with an id
    if kind == "maybe":
        return lambda e: e.get("id") if isinstance(e, dict) else None
    return None


def _ts_fn(kind: str) -> Any:
    if kind == "field":
        return lambda e: e["ts"]
    if kind == "huge":
        return lambda e: 10**30
    return None


record = st.tuples(
    st.sampled_from(GOOD_VALUES * 4 + BAD_VALUES + [None]),
    st.sampled_from([None, b"k1", b""]),
    st.sampled_from(list(HEADERS) + ["none"] * 6),
)


def _batch(rows: list[tuple[Any, Any, str]], first: int) -> pa.RecordBatch:
    n = len(rows)
    return pa.RecordBatch.from_arrays(
        [
            pa.array(["t"] * n, pa.string()),
            pa.array([2] * n, pa.int32()),
            pa.array(range(first, first + n), pa.int64()),
            pa.array([1000 + i for i in range(n)], pa.int64()),
            pa.array([k for _, k, _ in rows], pa.binary()),
            pa.array([v for v, _, _ in rows], pa.binary()),
            pa.array([pack_headers(HEADERS[h]) for _, _, h in rows], pa.binary()),
        ],
        names=list(RAW_COLUMNS),
    )


def _reference(rows, first, with_ids, id_fn, ts_fn):
    lane = tp_key("t", 2)
    out = []
    for i, (value, key, h) in enumerate(rows):
        raw = ("src", lane, "t", 2, first + i, 1000 + i, key, value, dict(HEADERS[h]))
        codec = value_codec("json")
        fn = id_fn if with_ids else None
        out.append(_decode_one(raw, codec, value_codec("raw"), "plain", fn, ts_fn, with_ids, True))
    return out


def _flat(items):
    return [r for i in items for r in (i.records() if isinstance(i, RecordColumns) else [i])]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(record, min_size=1, max_size=12),
    with_ids=st.booleans(),
    id_kind=st.sampled_from(["none", "field", "maybe"]),
    ts_kind=st.sampled_from(["none", "field", "huge"]),
)
def test_columns_say_what_record_by_record_decoding_says(rows, with_ids, id_kind, ts_kind):
    id_fn, ts_fn = _id_fn(id_kind), _ts_fn(ts_kind)
    source = KafkaSource("t", bootstrap_servers="127.0.0.1:1", id=id_fn, timestamp=ts_fn)
    got = _flat(source.decoder("src", with_ids)(_batch(rows, 40)))
    assert got == _reference(rows, 40, with_ids, id_fn, ts_fn)


def test_plain_records_come_as_columns_and_a_bad_one_makes_its_lane_record_by_record():
    """The hot path is taken: a lane of plain records is one ``RecordColumns``; one poison
    record in it sends that lane through the record-by-record path (its dead letter says why)."""
    source = KafkaSource("t", bootstrap_servers="127.0.0.1:1", id=lambda e: e["id"])
    plain = [(json.dumps({"id": f"e{i}"}).encode(), None, "none") for i in range(50)]
    [cols] = source.decoder("src", True)(_batch(plain, 0))
    assert isinstance(cols, RecordColumns) and len(cols) == 50
    assert cols.ids[3] == ids.from_user_key("e3") and cols.offsets[3] == 3
    poisoned = [*plain[:10], (b"{not json", None, "none"), *plain[10:]]
    items = list(source.decoder("src", True)(_batch(poisoned, 0)))
    assert not any(isinstance(i, RecordColumns) for i in items)
    assert [getattr(i, "code", None) for i in items].count("undecodable") == 1


@pytest.mark.parametrize("lanes", [1, 3])
def test_rows_of_several_lanes_in_one_batch_become_one_slice_per_lane(lanes):
    n = 12
    batch = pa.RecordBatch.from_arrays(
        [
            pa.array(["t"] * n, pa.string()),
            pa.array([i * lanes // n for i in range(n)], pa.int32()),
            pa.array(range(n), pa.int64()),
            pa.array([1] * n, pa.int64()),
            pa.array([None] * n, pa.binary()),
            pa.array([b"1"] * n, pa.binary()),
            pa.array([None] * n, pa.binary()),
        ],
        names=list(RAW_COLUMNS),
    )
    items = list(KafkaSource("t", bootstrap_servers="127.0.0.1:1").decoder("s", True)(batch))
    assert [i.lane for i in items] == [tp_key("t", p) for p in range(lanes)]
    assert sum(len(i) for i in items) == n
