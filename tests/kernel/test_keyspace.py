"""Every key is built and parsed in one module, and the two agree; the shard and seen-field
formulas agree with their vectorised forms, and a seen field with its shard gives its ID
back, so no two IDs of one shard are ever confused; the floor formula is the one GC and the
receivers share."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from onceflow.dedup.addressing import seen_fields, shards_of
from onceflow.kernel.errors import ConfigError
from onceflow.kernel.keyspace import Keyspace, Kind, floor_bucket, namespace_of_meta
from onceflow.kernel.seen_layout import (
    LAYOUT,
    check_layout,
    seen_field,
    seen_id,
    seen_width,
    shard_of,
)

NAMES = st.text(st.characters(blacklist_characters="\n\r", min_codepoint=33), min_size=1)


@given(NAMES, st.integers(0, 10**9), st.integers(0, 65535), st.integers(0, 10**6))
def test_every_key_parses_back_to_what_built_it(name, generation, shard, batch):
    ks = Keyspace("orders-eu.1")
    assert ks.parse(ks.seen(name, generation, shard)) == ks.parse(ks.seen(name, generation, shard))
    parsed = ks.parse(ks.seen(name, generation, shard))
    assert (parsed.kind, parsed.name, parsed.generation, parsed.shard) == (
        Kind.SEEN,
        name,
        generation,
        shard,
    )
    parsed = ks.parse(ks.backup(name, batch, shard))
    assert (parsed.kind, parsed.name, parsed.batch, parsed.partition) == (
        Kind.BACKUP,
        name,
        batch,
        shard,
    )
    assert ks.parse(ks.state(name, shard)).name == name
    assert ks.parse(ks.stats(name)).name == name
    assert ks.parse(ks.filter_snapshot(name)).kind is Kind.FILTER_SNAPSHOT
    assert ks.parse(ks.batch(batch)).batch == batch
    assert ks.parse(ks.pending(name, shard)).partition == shard


def test_keys_of_other_namespaces_or_kinds_parse_to_nothing():
    ks = Keyspace("a")
    assert ks.parse(Keyspace("b").meta) is None
    assert ks.parse("of:{a}:nonsense:1") is None
    assert ks.parse(ks.meta).kind is Kind.META
    assert namespace_of_meta(ks.meta) == "a"


@pytest.mark.parametrize("bad", ["", "with space", "a:b", "{x}", "star*"])
def test_namespaces_that_would_break_keys_are_refused(bad):
    with pytest.raises(ConfigError, match="namespace"):
        Keyspace(bad)


@given(
    st.lists(st.binary(min_size=16, max_size=16), min_size=1, max_size=50), st.integers(1, 65536)
)
def test_the_shard_formula_and_its_vectorised_form_agree(ids, shards):
    raw = np.frombuffer(b"".join(ids), dtype=np.uint8).reshape(-1, 16)
    assert list(shards_of(raw, shards)) == [shard_of(i, shards) for i in ids]


def test_the_floor_is_the_bucket_a_horizon_back():
    hour = 3_600_000
    assert floor_bucket(100 * hour + 5, 24 * hour, hour) == 76
    assert floor_bucket(5 * hour, 24 * hour, hour) == 0


IDS = st.binary(min_size=16, max_size=16)


@given(IDS, st.integers(1, 65536))
def test_a_seen_field_and_its_shard_give_the_id_back(rid, shards):
    field = seen_field(rid, shards)
    assert len(field) == seen_width(shards)
    assert seen_id(field, shard_of(rid, shards), shards) == rid


@given(st.lists(IDS, min_size=1, max_size=50), st.integers(1, 65536))
def test_the_seen_field_formula_and_its_vectorised_form_agree(ids, shards):
    raw = np.frombuffer(b"".join(ids), dtype=np.uint8).reshape(-1, 16)
    assert seen_fields(raw, shards) == b"".join(seen_field(i, shards) for i in ids)


@pytest.mark.parametrize(
    ("shards", "width"), [(65536, 14), (1024, 15), (256, 15), (255, 16), (1, 16)]
)
def test_a_seen_field_drops_what_the_shard_says(shards, width):
    assert seen_width(shards) == width


@pytest.mark.parametrize("shards", [1, 3, 255, 256, 1000, 1024, 4096, 65536])
@pytest.mark.parametrize("tail", [bytes(14), bytes(range(14)), b"\xff" * 14])
def test_ids_that_differ_only_in_the_bytes_that_pick_the_shard_are_never_confused(shards, tail):
    """Every ID with one tail: each prefix lands in some shard, where no other has its field.

    Many of them share a shard (65,536 prefixes over ``shards`` shards): a field of bytes
    2..15 alone would confuse all of those.
    """
    ids = [p.to_bytes(2, "big") + tail for p in range(65536)]
    placed = {(shard_of(i, shards), seen_field(i, shards)) for i in ids}
    assert len(placed) == len(ids)


def test_little_endian_counters_keep_one_field_each_per_shard():
    """Structured IDs (a counter written little-endian) differ in bytes 0-1 first."""
    ids = [i.to_bytes(16, "little") for i in range(200_000)]
    placed = {(shard_of(i, 1024), seen_field(i, 1024)) for i in ids}
    assert len(placed) == len(ids)


def test_an_old_or_unknown_layout_is_refused_with_what_to_do():
    check_layout(str(LAYOUT), True, "n")
    check_layout(b"3", True, "n")
    check_layout(None, False, "n")  # a new namespace
    for stored, has_state in ((None, True), (b"1", True), (b"2", False), (b"4", True)):
        with pytest.raises(ConfigError, match=r"^namespace 'n' was made by an older version"):
            check_layout(stored, has_state, "n")
    with pytest.raises(ConfigError, match="layout 5, which this onceflow does not know"):
        check_layout(b"5", True, "n")
