"""The Bloom filters: never a false "no", the configured false-positive rate, rotation past
capacity, neighbour buckets, and snapshots that answer exactly as the original."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from onceflow.dedup.bloom import IdBloomFilter, ReceiverFilters


def _ids(n, seed=0):
    rng = np.random.default_rng(seed)
    return [bytes(r) for r in rng.integers(0, 256, size=(n, 16), dtype=np.uint8)]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.binary(min_size=16, max_size=16), min_size=1, max_size=300, unique=True))
def test_an_added_id_is_never_reported_new(ids):
    f = ReceiverFilters(capacity=100, error_rate=0.01)  # small: rotates within the example
    first = f.check_and_add(ids, [7] * len(ids), [None] * len(ids))
    again = f.check_and_add(ids, [7] * len(ids), [None] * len(ids))
    assert all(again)
    assert len(f.buckets[7]) >= len(ids) // 100
    assert sum(first) <= max(3, len(ids) // 10)  # mostly new the first time


def test_false_positive_rate_is_as_configured():
    for error in (0.01, 0.001):
        f = IdBloomFilter(capacity=50_000, error_rate=error)
        f.add_many(_ids(50_000, seed=1))
        probes = _ids(200_000, seed=2)
        rate = float(np.mean(f.contains_many(probes)))
        assert rate <= 1.5 * error, f"measured {rate:.5f} for a configured {error}"


def test_sequential_and_structured_ids_spread_as_well_as_random_ones():
    f = IdBloomFilter(capacity=20_000, error_rate=0.01)
    f.add_many([i.to_bytes(16, "big") for i in range(20_000)])
    probes = [(i << 64).to_bytes(16, "big") for i in range(1, 50_001)]
    assert float(np.mean(f.contains_many(probes))) <= 0.015


def test_rotation_past_capacity_keeps_the_rate_and_every_id():
    f = ReceiverFilters(capacity=1_000, error_rate=0.01)
    ids = _ids(5_500, seed=3)
    f.check_and_add(ids, [1] * len(ids), [None] * len(ids))
    assert len(f.buckets[1]) == 6, "a full filter gets a successor in the same bucket"
    assert all(f.check_and_add(ids, [1] * len(ids), [None] * len(ids)))
    probes = _ids(20_000, seed=4)
    maybe = np.zeros(len(probes), bool)
    for x in f.buckets[1]:
        maybe |= x.contains_many(probes)
    assert np.mean(maybe) <= 6 * 0.01 * 1.5  # one chance per generation in the chain


def test_neighbour_bucket_is_consulted_but_not_filled():
    f = ReceiverFilters(capacity=1_000, error_rate=0.001)
    ids = _ids(100, seed=5)
    f.check_and_add(ids, [10] * 100, [None] * 100)
    assert all(f.check_and_add(ids, [11] * 100, [10] * 100))
    assert not any(f.check_and_add(_ids(100, seed=6), [12] * 100, [10] * 100))
    assert f.drop_before(11) == [10] and 10 not in f.buckets


def test_snapshot_round_trip_answers_exactly_as_the_original():
    f = ReceiverFilters(capacity=2_000, error_rate=0.01)
    ids = _ids(3_000, seed=7)
    f.check_and_add(ids, [4] * len(ids), [None] * len(ids))
    blob = f.dump_bucket(4)
    assert len(blob) < sum(x.num_bits // 8 for x in f.buckets[4]), "snapshots are compressed"
    g = ReceiverFilters(capacity=2_000, error_rate=0.01)
    g.load_bucket(4, blob)
    probes = ids + _ids(10_000, seed=8)
    a = np.zeros(len(probes), bool)
    b = np.zeros(len(probes), bool)
    for x in f.buckets[4]:
        a |= x.contains_many(probes)
    for x in g.buckets[4]:
        b |= x.contains_many(probes)
    assert (a == b).all() and a[: len(ids)].all()
