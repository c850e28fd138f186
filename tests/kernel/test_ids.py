from __future__ import annotations

import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from onceflow.kernel import ids
from onceflow.kernel.errors import CodecError


@given(
    st.text(min_size=1, max_size=10),
    st.text(max_size=10),
    st.integers(0, 100),
    st.integers(0, 2**40),
)
def test_position_ids_are_16_bytes_and_stable(source, topic, partition, offset):
    a = ids.from_position(source, topic, partition, offset)
    assert len(a) == 16
    assert a == ids.from_position(source, topic, partition, offset)


def test_position_ids_differ_by_each_component():
    base = ids.from_position("src", "t", 0, 1)
    assert (
        len(
            {
                base,
                ids.from_position("src2", "t", 0, 1),
                ids.from_position("src", "u", 0, 1),
                ids.from_position("src", "t", 1, 1),
                ids.from_position("src", "t", 0, 2),
            }
        )
        == 5
    )


@given(st.binary(min_size=16, max_size=16), st.integers(0, 1000), st.text(min_size=1, max_size=8))
def test_derived_ids_are_stable_and_distinct_per_index(parent, index, boundary):
    d = ids.Deriver(boundary)
    child = d.child(parent, index)
    assert child == ids.Deriver(boundary).child(parent, index)
    assert child != d.child(parent, index + 1)
    assert child != ids.Deriver(boundary + "x").child(parent, index)


def test_user_keys_uuid_and_raw_bytes_keep_their_bits():
    u = uuid.uuid4()
    assert ids.from_user_key(u) == u.bytes
    assert ids.from_user_key(str(u)) == u.bytes
    assert ids.from_user_key(b"0123456789abcdef") == b"0123456789abcdef"


@given(st.text(min_size=1) | st.integers() | st.binary(max_size=15))
def test_other_user_keys_hash_stably(key):
    assert ids.from_user_key(key) == ids.from_user_key(key)
    assert len(ids.from_user_key(key)) == 16


def test_bad_user_key_type_is_explained():
    with pytest.raises(CodecError, match="must return str, bytes, int or uuid.UUID"):
        ids.from_user_key(3.5)


def test_header_ids_of_16_bytes_are_taken_as_they_are():
    assert ids.from_header(b"x" * 16) == b"x" * 16


def test_a_uuid_header_as_text_or_bytes_is_one_id():
    u = uuid.uuid4()
    assert ids.from_header(str(u).encode()) == u.bytes == ids.from_header(u.bytes)
    assert ids.from_header(f" {u} ".encode()) == u.bytes, "surrounding blanks do not matter"


def test_other_header_texts_are_hashed_like_business_keys():
    assert ids.from_header(b"order-17") == ids.from_user_key("order-17")
    assert ids.from_header(b"order-17") != ids.from_header(b"order-18")
    assert len(ids.from_header(b"\xff\xfe not utf-8")) == 16


@pytest.mark.parametrize("value", [b"", None, b"x" * 2000])
def test_empty_or_absurd_header_ids_are_refused(value):
    with pytest.raises(CodecError, match="header"):
        ids.from_header(value)


@given(st.integers(0, 2**62))
def test_timestamp_header_round_trip(ts):
    assert ids.parse_ts_header(ids.ts_header(ts)) == ts


def test_derivation_from_parts_is_length_prefixed():
    d = ids.Deriver("x")
    assert d.of("ab", "c") != d.of("a", "bc")


@given(st.lists(st.integers(min_value=0, max_value=2**63 - 1), max_size=50))
def test_a_slice_of_position_ids_is_each_offsets_own(offsets):
    made = ids.from_positions("src", "t", 3, offsets)
    assert made == [ids.from_position("src", "t", 3, o) for o in offsets]
    assert len(set(made)) == len(set(offsets))  # two offsets of a lane never share an ID


def test_position_ids_spread_over_seen_shards_and_differ_between_lanes():
    from collections import Counter

    from onceflow.kernel.seen_layout import shard_of

    made = ids.from_positions("src", "t", 0, list(range(64_000)))
    per_shard = Counter(shard_of(rid, 64) for rid in made)
    assert len(per_shard) == 64 and max(per_shard.values()) < 1.1 * 1000
    assert not set(made) & set(ids.from_positions("src", "t", 1, list(range(64_000))))
    assert not set(made) & set(ids.from_positions("other", "t", 0, list(range(64_000))))
