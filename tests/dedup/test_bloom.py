"""The Bloom filters: never a false "no", the configured false-positive rate, rotation past
capacity, checks across every live generation, and snapshots that answer as the original."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from onceflow.dedup.bloom import IdBloomFilter, ReceiverFilters, positions, shape
from onceflow.dedup.config import DedupConfig


def _ids(n, seed=0):
    rng = np.random.default_rng(seed)
    return [bytes(r) for r in rng.integers(0, 256, size=(n, 16), dtype=np.uint8)]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.binary(min_size=16, max_size=16), min_size=1, max_size=300, unique=True))
def test_an_added_id_is_never_reported_new(ids):
    f = ReceiverFilters(capacity=100, error_rate=0.01)  # small: rotates within the example
    first = f.check_and_add(ids, 7, (7,))
    again = f.check_and_add(ids, 7, (7,))
    assert all(again)
    assert len(f.generations[7]) >= len(ids) // 100
    assert sum(first) <= max(3, len(ids) // 10)  # mostly new the first time


def test_the_shape_formula_matches_pybloom_live():
    for capacity, error in ((100, 0.01), (100_000, 0.001), (50_000, 1e-4), (7, 0.3)):
        f = IdBloomFilter(capacity, error)
        assert shape(capacity, error) == (f.num_slices, f.bits_per_slice)
        ids = _ids(50, seed=capacity)
        byte, bit = positions(ids, *shape(capacity, error))
        own_byte, own_bit = f._positions(ids)
        assert (byte == own_byte).all() and (bit == own_bit).all()


_MASK = (1 << 64) - 1


def _mix_int(x):
    """splitmix64's finalizer on Python ints: an independent reference for the numpy one."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def test_bit_positions_are_the_documented_double_hashing_whatever_form_the_ids_take():
    # Snapshots in Redis hold bits set by earlier versions: positions must never move.
    slices, bits = shape(100_000, 0.001)
    ids = [*_ids(200, seed=5), bytes(16), b"\xff" * 16]
    byte, bit = positions(ids, slices, bits)
    blob_byte, blob_bit = positions(b"".join(ids), slices, bits)
    assert (byte == blob_byte).all() and (bit == blob_bit).all()
    for n, rid in enumerate(ids):
        a = int.from_bytes(rid[:8], "little")
        b = int.from_bytes(rid[8:], "little")
        h1 = _mix_int(a ^ _mix_int(b))
        h2 = _mix_int(b ^ _mix_int((a + 0x632BE59BD9B4E019) & _MASK))
        for k in range(slices):
            pos = ((h1 + k * h2) & _MASK) % bits + k * bits
            assert (byte[n, k], bit[n, k]) == (pos >> 3, pos & 7)


def test_catching_up_from_a_journal_blob_equals_adding_the_ids():
    ids = _ids(3_000, seed=8)
    one, other = ReceiverFilters(1_000, 0.01), ReceiverFilters(1_000, 0.01)
    one.add(ids, 4)
    other.add(b"".join(ids), 4)
    assert [f.bitarray.tobytes() for f in one.generations[4]] == [
        f.bitarray.tobytes() for f in other.generations[4]
    ]
    assert len(other.generations[4]) == 3  # rotated past capacity on the way


def test_false_positive_rate_is_as_configured():
    for error in (0.01, 0.001):
        f = IdBloomFilter(capacity=50_000, error_rate=error)
        f.add_many(_ids(50_000, seed=1))
        probes = _ids(200_000, seed=2)
        rate = float(np.mean(f.contains_many(probes)))
        assert rate <= 1.5 * error, f"measured {rate:.5f} for a configured {error}"


def test_a_check_across_every_live_generation_meets_the_configured_rate():
    config = DedupConfig(bloom_capacity=20_000, bloom_error=0.001)
    f = ReceiverFilters(config.bloom_capacity, config.filter_error)
    for generation in range(config.live_generations):
        f.check_and_add(_ids(20_000, seed=100 + generation), generation, (generation,))
    probes = _ids(200_000, seed=99)
    every = range(config.live_generations + 1)
    rate = float(np.mean(f.check_and_add(probes, config.live_generations, every)))
    assert rate <= 1.5 * config.bloom_error, f"measured {rate:.5f} with every filter full"


def test_sequential_and_structured_ids_spread_as_well_as_random_ones():
    f = IdBloomFilter(capacity=20_000, error_rate=0.01)
    f.add_many([i.to_bytes(16, "big") for i in range(20_000)])
    probes = [(i << 64).to_bytes(16, "big") for i in range(1, 50_001)]
    assert float(np.mean(f.contains_many(probes))) <= 0.015


def test_rotation_past_capacity_keeps_the_rate_and_every_id():
    f = ReceiverFilters(capacity=1_000, error_rate=0.01)
    ids = _ids(5_500, seed=3)
    f.check_and_add(ids, 1, (1,))
    assert len(f.generations[1]) == 6, "a full filter gets a successor in the same generation"
    assert all(f.check_and_add(ids, 1, (1,)))
    probes = _ids(20_000, seed=4)
    maybe = np.zeros(len(probes), bool)
    for x in f.generations[1]:
        maybe |= x.contains_many(probes)
    assert np.mean(maybe) <= 6 * 0.01 * 1.5  # one chance per filter in the chain


def test_older_live_generations_are_consulted_and_dead_ones_are_not():
    f = ReceiverFilters(capacity=1_000, error_rate=0.001)
    ids = _ids(100, seed=5)
    f.check_and_add(ids, 10, (10,))
    assert all(f.check_and_add(ids, 12, (12, 10))), "a copy is found in an older live generation"
    # ... and still goes into the batch's generation: the older one's "maybe" may have been
    # a false positive (then the ID is committed here), and the older one expires first
    assert all(f.generations[12][0].contains_many(ids))
    assert f.generations[12][0].count == len(ids)
    assert not any(f.check_and_add(_ids(100, seed=6), 13, (13, 11))), "dead ones are not asked"
    assert all(f.check_and_add(ids, 13, (13, 12))), "known through the batch's generation"
    assert f.keep_only({12, 13}) == [10] and 10 not in f.generations


def test_snapshot_round_trip_answers_exactly_as_the_original():
    f = ReceiverFilters(capacity=2_000, error_rate=0.01)
    ids = _ids(3_000, seed=7)
    f.check_and_add(ids, 4, (4,))
    blob = f.dump(4)
    assert len(blob) < sum(x.num_bits // 8 for x in f.generations[4]), "snapshots are compressed"
    g = ReceiverFilters(capacity=2_000, error_rate=0.01)
    g.load(4, blob)
    probes = ids + _ids(10_000, seed=8)
    assert f.check_and_add(probes, 99, (99, 4))[: len(ids)] == [True] * len(ids)
    h = ReceiverFilters(capacity=2_000, error_rate=0.01)
    h.load(4, blob)
    a = np.zeros(len(probes), bool)
    b = np.zeros(len(probes), bool)
    for x in f.generations[4]:
        a |= x.contains_many(probes)
    for x in g.generations[4]:
        b |= x.contains_many(probes)
    assert (a == b).all() and a[: len(ids)].all()
