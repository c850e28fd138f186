from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from onceflow.kernel import codec
from onceflow.kernel.codec import value_codec
from onceflow.kernel.errors import CodecError

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=5) | st.integers(-(2**63), 2**63), inner, max_size=4)
    ),
    max_leaves=20,
)


@given(values)
def test_round_trip_preserves_values_and_tuples(value):
    assert codec.decode(codec.encode(value)) == value
    if isinstance(value, tuple):
        assert isinstance(codec.decode(codec.encode(value)), tuple)


def test_lists_and_tuples_stay_distinct():
    decoded = codec.decode(codec.encode({"t": (1, [2, (3,)]), "l": [1, 2]}))
    assert decoded == {"t": (1, [2, (3,)]), "l": [1, 2]}
    assert isinstance(decoded["t"], tuple) and isinstance(decoded["t"][1], list)


def test_subclasses_are_encoded_as_their_base_types():
    from collections import OrderedDict

    assert type(codec.decode(codec.encode(OrderedDict(a=1)))) is dict
    assert codec.decode(codec.encode(OrderedDict(a=1))) == {"a": 1}


def test_unsupported_type_names_the_type_and_the_fix():
    with pytest.raises(CodecError, match="'object'.*convert it"):
        codec.encode({"x": object()})
    assert codec.decode(codec.encode([1, (2,)])) == [1, (2,)]  # the packer still works


def test_integers_beyond_64_bits_are_refused_with_a_fix():
    with pytest.raises(CodecError, match="64-bit.*str"):
        codec.encode({"n": 2**70})


def test_garbage_bytes_are_a_codec_error_not_a_crash():
    with pytest.raises(CodecError, match="cannot decode"):
        codec.decode(b"\xc1\xc1\xc1")


def test_decoding_never_runs_code():
    import pickle

    payload = pickle.dumps(print)  # a pickle would import and reference builtins.print
    with pytest.raises(CodecError):
        codec.decode(payload)


@pytest.mark.parametrize(
    ("name", "raw", "value"),
    [
        ("json", b'{"a":[1,2]}', {"a": [1, 2]}),
        ("utf-8", "héllo".encode(), "héllo"),
        ("utf8", b"x", "x"),
        ("raw", b"\x00\x01", b"\x00\x01"),
        ("bytes", b"z", b"z"),
    ],
)
def test_value_codecs_decode_and_encode_back(name, raw, value):
    c = codec.value_codec(name)
    assert c.decode(raw) == value
    assert c.decode(c.encode(value)) == value


def test_unknown_codec_lists_the_known_ones():
    with pytest.raises(CodecError, match="json.*msgpack.*raw.*utf-8"):
        codec.value_codec("avro")


def test_utf8_codec_rejects_non_strings_with_a_fix():
    with pytest.raises(CodecError, match="map to str first"):
        codec.value_codec("utf-8").encode(42)


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()  # past 64 bits too: json keeps them whole
    | st.floats()  # NaN and infinities: json writes and reads them
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@given(_json_values, st.booleans())
def test_the_json_codec_reads_what_json_reads(value, ascii_only):
    """orjson speeds the reading up; what comes out must be what ``json.loads`` gives."""
    data = json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    try:
        want = repr(json.loads(data))
    except ValueError as exc:
        with pytest.raises(type(exc)):
            value_codec("json").decode(data)
        return
    assert repr(value_codec("json").decode(data)) == want


@pytest.mark.parametrize(
    "raw",
    [b"123456789012345678901234567890", b'{"n": -98765432109876543210}', b"NaN", b"[Infinity]",
     b"1e999", b"\xef\xbb\xbf{}", b'"\\ud800"', b"0.12345678901234567890123",
     b"-9223372036854775809", b"-9223372036854775808", b"9223372036854775808",
     b"18446744073709551615", b"18446744073709551616", b'{"ts_ns": 1795971863405709000}',
     b"1234567890123456789.5", b"-1234567890123456789.5e3", b"[1,-99999999999999999999]"],
)  # fmt: skip
def test_the_json_codec_reads_what_orjson_would_read_otherwise_like_json(raw):
    assert repr(value_codec("json").decode(raw)) == repr(json.loads(raw))


@given(_json_values, st.lists(_json_values, max_size=4))
def test_many_json_values_read_as_each_alone(value, others):
    """A source's slice is read in one go (``decode_many``): each value as json reads it,
    numbers of 19 digits and more among them included (orjson would make floats of some)."""
    raws = [json.dumps(v).encode("utf-8", "surrogatepass") for v in [*others, value]]
    try:
        want = [repr(json.loads(r)) for r in raws]
    except ValueError:
        return
    json_codec = value_codec("json")
    assert json_codec.decode_many is not None
    assert [repr(v) for v in json_codec.decode_many(raws)] == want


@pytest.mark.parametrize("raw", ['{"a": [1, 2.5, "x"]}', '"text"', "12345678901234567890"])
def test_the_json_codec_reads_text_as_json_does(raw):
    assert repr(value_codec("json").decode(raw)) == repr(json.loads(raw))


@pytest.mark.parametrize("value", [b"raw bytes", {1, 2}, {("a", 1): 2}, object()], ids=repr)
def test_what_json_cannot_write_is_a_codec_error_so_a_sink_makes_it_a_dead_letter(value):
    # a TypeError here failed the task (the sink turns only CodecError into a dead letter)
    with pytest.raises(CodecError, match="json codec cannot write"):
        value_codec("json").encode(value)


def test_a_kafka_key_json_cannot_write_is_a_codec_error():
    from onceflow.connectors.kafka.serialization import key_bytes

    assert key_bytes(("a", 1)) == b'["a",1]'
    with pytest.raises(CodecError, match="record key"):
        key_bytes(object())


_writable = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()  # past 64 bits too: orjson refuses them, json writes them whole
    | st.floats()  # NaN and infinities: orjson would write null, json writes NaN
    | st.text(),  # lone surrogates: orjson refuses them, and so does UTF-8
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text() | st.integers(), inner, max_size=4)
    ),  # int keys: json's "1"
    max_leaves=12,
)


@given(_writable)
def test_the_json_codec_writes_what_json_writes(value):
    """orjson speeds the writing up; what it writes reads back as json's own text does, and
    what json refuses is refused (a dead letter), never written otherwise."""
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    except (TypeError, ValueError):
        with pytest.raises(CodecError):
            value_codec("json").encode(value)
        return
    out = value_codec("json").encode(value)
    assert repr(json.loads(out)) == repr(json.loads(text))


def test_named_tuples_and_dataclasses_are_written_as_json_writes_them():
    import collections
    import dataclasses

    pair = collections.namedtuple("pair", "a b")

    @dataclasses.dataclass
    class Order:
        id: str
        items: tuple[int, ...]

    assert value_codec("json").encode(pair(1, "x")) == b'[1,"x"]'
    written = value_codec("json").encode({"o": Order("a", (1, 2))})
    assert written == b'{"o":{"id":"a","items":[1,2]}}'


@given(
    st.datetimes(timezones=st.none() | st.timezones())
    | st.dates()
    | st.datetimes().map(lambda d: {"at": d, "day": d.date()})
)
def test_datetimes_and_dates_travel_as_they_are_naive_or_aware(value):
    # a record may carry a timestamp (a PostgreSQL timestamptz column, issue 42)
    back = codec.decode(codec.encode(value))
    assert back == value and type(back) is type(value)
    if hasattr(value, "utcoffset"):
        assert back.utcoffset() == value.utcoffset()


def test_the_json_codec_writes_datetimes_as_iso_text():
    from datetime import UTC, date, datetime

    at = datetime(2026, 3, 1, 12, 30, tzinfo=UTC)
    assert json.loads(value_codec("json").encode({"at": at, "day": date(2026, 3, 1)})) == {
        "at": "2026-03-01T12:30:00+00:00",
        "day": "2026-03-01",
    }
