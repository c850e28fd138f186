"""Every key is built and parsed in one module, and the two agree; the shard formula agrees
with its vectorised form; the floor formula is the one GC and the receivers share."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from onceflow.dedup.addressing import shards_of
from onceflow.kernel.errors import ConfigError
from onceflow.kernel.keyspace import Keyspace, Kind, floor_bucket, namespace_of_meta, shard_of

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
