"""Sources' decoding of raw rows, without a broker: what a Kafka header can and cannot make
of a record. A header a producer set (or forwarded) never drops a record's value or stops the
pipeline; bad ones make dead letters with their reason."""

from __future__ import annotations

import uuid

import pyarrow as pa
import pytest

from onceflow.connectors.decoded import RecordColumns
from onceflow.connectors.kafka.source import KafkaSource
from onceflow.connectors.kafka.worker import RAW_COLUMNS, _gap, pack_headers, raw_rows
from onceflow.kernel import ids
from onceflow.kernel.errors import CodecError
from onceflow.kernel.records import DeadLetter, Record


def _decode(rows, source=None, **options):
    """Decoded items of raw rows ``(offset, kafka ts, key, value, headers)`` of ``t:0``, by
    ``source`` or a KafkaSource made with ``options``."""
    offsets, kts, keys, values, headers = zip(*rows, strict=True)
    batch = pa.RecordBatch.from_arrays(
        [
            pa.array(["t"] * len(rows), pa.string()),
            pa.array([0] * len(rows), pa.int32()),
            pa.array(offsets, pa.int64()),
            pa.array(kts, pa.int64()),
            pa.array(keys, pa.binary()),
            pa.array(values, pa.binary()),
            pa.array([pack_headers(h) for h in headers], pa.binary()),
        ],
        names=list(RAW_COLUMNS),
    )
    source = source or KafkaSource("t", bootstrap_servers="127.0.0.1:1", **options)
    return flat(source.decoder("src", True)(batch))


def flat(items):
    """Decoded items with a lane's columns (the hot path) as the records they stand for."""
    return [r for i in items for r in (i.records() if isinstance(i, RecordColumns) else [i])]


@pytest.mark.parametrize("gap", [b"oops", b"5-3", b"7-9", b"\xff"])
def test_a_gap_header_on_an_ordinary_record_leaves_it_an_ordinary_record(gap):
    [item] = _decode([(7, 1, None, b'{"x": 1}', [(ids.GAP_HEADER, gap)])])
    assert isinstance(item, Record) and item.elem == {"x": 1}


def test_the_readers_own_gap_marker_is_a_data_loss_dead_letter():
    marker = raw_rows("t", 0, _gap("t", 0, 40, 45, 50, "report")).to_pylist()[0]
    row = (40, 0, None, None, [(ids.GAP_HEADER, b"40-45")])
    assert (marker["offset"], marker["ts"], marker["key"], marker["value"]) == row[:4]
    assert marker["headers"] == pack_headers(row[4])
    [letter] = _decode([row])
    assert isinstance(letter, DeadLetter) and letter.code == "data_loss" and letter.lost == 5


def test_an_id_header_without_a_value_is_a_dead_letter_not_a_position_id():
    [letter] = _decode([(3, 1, None, b"1", [(ids.ID_HEADER, None)])])
    assert isinstance(letter, DeadLetter) and letter.code == "no_id"


@pytest.mark.parametrize("ts", [b"1" + b"0" * 30, b" 1_000 ", b"12x", b"", b"\xd9\xa1\xd9\xa2"])
def test_an_event_time_header_that_is_not_64_bit_milliseconds_is_a_dead_letter(ts):
    [letter] = _decode([(9, 1, None, b"1", [(ids.TS_HEADER, ts)])])
    assert isinstance(letter, DeadLetter) and letter.code == "no_time"


def test_event_time_headers_in_range_are_read():
    assert ids.parse_ts_header(b"-5") == -5
    assert ids.parse_ts_header(ids.ts_header(2**63 - 1)) == 2**63 - 1
    with pytest.raises(CodecError):
        ids.parse_ts_header(b"9" * 19 + b"9")


def test_a_timestamp_function_beyond_64_bits_is_a_dead_letter():
    src = KafkaSource("t", bootstrap_servers="127.0.0.1:1", timestamp=lambda e: 10**30)
    batch = pa.RecordBatch.from_arrays(
        [
            pa.array(v, t)
            for v, t in zip(
                (["t"], [0], [1], [1], [None], [b"1"], [None]),
                (
                    pa.string(),
                    pa.int32(),
                    pa.int64(),
                    pa.int64(),
                    pa.binary(),
                    pa.binary(),
                    pa.binary(),
                ),
                strict=True,
            )
        ],
        names=list(RAW_COLUMNS),
    )
    [letter] = src.decoder("src", True)(batch)
    assert isinstance(letter, DeadLetter) and letter.code == "no_time"


def test_the_same_uuid_as_text_or_bytes_is_one_id():
    u = uuid.uuid4()
    forms = [u.bytes, str(u).encode(), str(u).upper().encode(), f" {u}\n".encode()]
    assert {ids.from_header(f) for f in forms} == {u.bytes}


def test_a_partition_that_went_back_stops_the_run_instead_of_skipping_records():
    from pyspark.sql.datasource import ReadAllAvailable

    from onceflow.connectors.errors import ConnectorError
    from onceflow.connectors.kafka.datasource import KafkaStreamReader

    reader = KafkaStreamReader({"bootstrap": "127.0.0.1:1", "topics": ["t"]})
    reader._partitions = lambda: ["t:0", "t:1"]  # no broker: the reader's own lookups
    ends = {"t:0": 5, "t:1": 1_200}  # t:0 re-created: 5 records where 1,000 were read
    reader._highwater = lambda tps: dict(ends)
    with pytest.raises(ConnectorError, match="t:0 ends at 5, read up to 1000"):
        reader.latestOffset({"t:0": 1_000, "t:1": 1_000}, ReadAllAvailable())
    ends["t:0"] = 1_000
    assert reader.latestOffset({"t:0": 1_000, "t:1": 1_000}, ReadAllAvailable()) == {
        "t:0": 1_000,
        "t:1": 1_200,
    }


def test_a_collections_timestamp_beyond_64_bits_is_a_dead_letter_too():
    from onceflow.connectors.collections import _record

    letter = _record("src", "collection", 3, {"x": 1}, None, lambda v: 10**30, True)
    assert isinstance(letter, DeadLetter) and "64-bit" in letter.error
    record = _record("src", "collection", 3, {"x": 1}, None, lambda v: 5, True)
    assert isinstance(record, Record) and record.ts == 5


def test_only_a_position_id_read_by_the_python_data_source_is_positional():
    """A record without an ID header or id function is known by its position; a replay of
    its micro-batch reads it in the same task again, so it needs no seen-mark (see
    onceflow.dedup.admission). A header, an id function or Spark's own connector (which plans
    its own ranges) make an ordinary ID."""
    plain, headed = (5, 1, None, b'{"k": "a"}', []), (6, 1, None, b"1", [(ids.ID_HEADER, b"e-1")])
    by_position, by_header = _decode([plain, headed])
    assert by_position.positional and by_position.id == ids.from_position("src", "t", 0, 5)
    assert not by_header.positional and by_header.id == ids.from_user_key("e-1")
    [by_function] = _decode([plain], id=lambda e: e["k"])
    assert not by_function.positional and by_function.id == ids.from_user_key("a")
    [confluent] = _decode([plain], client="confluent")
    assert confluent.positional
    [spark] = _decode([plain], client="spark")
    assert not spark.positional and spark.id == by_position.id


def test_dead_letters_still_carry_the_position_id_when_the_record_has_none():
    undecodable, bad_id, bad_time = _decode(
        [
            (1, 1, None, b"{not json", []),
            (2, 1, None, b"1", [(ids.ID_HEADER, b"")]),
            (3, 1, None, b"1", [(ids.TS_HEADER, b"x")]),
        ]
    )
    assert undecodable.id == ids.from_position("src", "t", 0, 1)
    assert bad_id.id == ids.from_position("src", "t", 0, 2)
    assert bad_time.id == ids.from_position("src", "t", 0, 3)
    [no_ids] = flat(
        KafkaSource("t", bootstrap_servers="127.0.0.1:1").decoder("src", False)(
            pa.RecordBatch.from_arrays(
                [
                    pa.array(["t"], pa.string()),
                    pa.array([0], pa.int32()),
                    pa.array([4], pa.int64()),
                    pa.array([1], pa.int64()),
                    pa.array([None], pa.binary()),
                    pa.array([b"1"], pa.binary()),
                    pa.array([None], pa.binary()),
                ],
                names=list(RAW_COLUMNS),
            )
        )
    )
    assert no_ids.id == b"" and not no_ids.positional


def test_a_query_with_a_source_spark_plans_takes_no_position_id_as_settled():
    """A union numbers its tasks on from one source's partitions to the next; Spark's own
    connector plans its partitions, so a replay may give the Python source's ranges other
    task numbers. Sources alone, or unions of sources planned from the offset log, keep them."""
    from onceflow.runtime.driver.startup import one_query

    alone = KafkaSource("a", bootstrap_servers="127.0.0.1:1")
    run = alone.for_run(one_query([alone]))
    assert run.positional_ids and run.read_in_task
    a, b = (KafkaSource(t, bootstrap_servers="127.0.0.1:1") for t in "ab")
    union = one_query([a, b])
    for source in (a.for_run(union), b.for_run(union)):
        assert source.positional_ids and source.read_in_task
    given, spark = (
        KafkaSource(t, bootstrap_servers="127.0.0.1:1", client=c)
        for t, c in (("p", "python"), ("s", "spark"))
    )
    python = given.for_run(one_query([spark, given]))
    assert not python.positional_ids and not python.read_in_task
    assert given.positional_ids and given.read_in_task  # the user's object is left as it was
    [record] = _decode([(5, 1, None, b'{"k": "a"}', [])], source=python)
    assert not record.positional and record.id == ids.from_position("src", "t", 0, 5)


def test_an_id_function_wins_over_the_id_header_and_none_leaves_it_to_the_header():
    """What the user asked for wins over what a record carries (an app may copy headers)."""
    from onceflow.connectors.kafka.decode import _record_id
    from onceflow.kernel import ids

    header = {"onceflow-id": b"copied-by-an-app"}
    assert _record_id(header, lambda e: e["id"], {"id": "e-1"}) == ids.from_user_key("e-1")
    assert _record_id(header, lambda e: e.get("id"), {}) == ids.from_header(b"copied-by-an-app")
    assert _record_id({}, None, {}) is None  # neither: the position is the ID
    with pytest.raises(Exception, match="id function must return"):
        _record_id({}, lambda e: e.get("id"), {})  # None and no header: a dead letter
