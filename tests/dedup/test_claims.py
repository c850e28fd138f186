"""Layout 4's claim script on a real Redis (docs/concepts/dedup.md; not wired in yet).

A claim checks an ID in every live generation of its ID tag and claims it in the batch's
generation with its record's origin; a second attempt of the same batch finds its own
origin, a copy finds another one. The tag names hash into their slot ranges, so the tags
spread over masters by their slots.
"""

from __future__ import annotations

import os

import pytest
from redis.crc import key_slot

from onceflow.backup.store import inputs_args
from onceflow.dedup.claims import claim_calls, remark, settle
from onceflow.kernel.id_tags import SLOTS, id_tag, id_tag_scope, origin, slot_range
from onceflow.kernel.keyspace import Keyspace, print_value
from onceflow.kernel.scripts import scripts_for

SHARDS = 64
TAGS = 8


def _ids(n: int, seed: int) -> list[bytes]:
    import random

    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(n)]


def _values(n: int, lane: int, fingerprint: int = 7) -> list[bytes]:
    return [origin(lane, offset) + print_value(fingerprint) for offset in range(n)]


def _claim(client, namespace, rids, values, generations, server=None):  # type: ignore[no-untyped-def]
    calls = claim_calls(
        namespace, TAGS, SHARDS, "src", generations, rids, values, server or {}, newest=1_000
    )
    script = scripts_for(client).claim_ids
    replies = [script(keys=c.keys, args=c.args, client=client) for c in calls]
    return calls, replies


def _seen_count(client, namespace: str, generation: int) -> int:  # type: ignore[no-untyped-def]
    total = 0
    for k in range(TAGS):
        ks = id_tag(namespace, k, TAGS)
        total += sum(client.hlen(ks.seen("src", generation, s)) for s in range(SHARDS))
    return total


def test_tags_hash_into_their_slot_ranges_and_spread_evenly_over_masters():
    tags = 96
    slots = [key_slot(f"ns:{id_tag_scope('ns', k, tags)}".encode()) for k in range(tags)]
    assert all(s in slot_range(k, tags) for k, s in enumerate(slots))
    thirds = [sum(1 for s in slots if m * SLOTS // 3 <= s < (m + 1) * SLOTS // 3) for m in range(3)]
    assert thirds == [32, 32, 32]


def test_every_key_of_a_claim_call_is_in_its_tag_slot():
    rids = _ids(500, 1)
    calls = claim_calls("ns", TAGS, SHARDS, "src", [5, 4, 3], rids, _values(500, 1), {}, 0)
    assert sorted(c.tag for c in calls) == list(range(TAGS))
    for call in calls:
        assert len({key_slot(k.encode()) for k in call.keys}) == 1
    assert sorted(j for c in calls for j in c.members) == list(range(500))


@pytest.mark.redis
def test_new_ids_are_claimed_and_a_replay_finds_its_own_origin(redis_server):
    client, namespace = redis_server.client(), f"claims-own-{os.getpid()}"
    rids, values = _ids(300, 2), _values(300, lane=1)
    calls, replies = _claim(client, namespace, rids, values, [5, 4])
    assert all(r[0] == b"ok" and r[1] == [] for r in replies)
    assert _seen_count(client, namespace, 5) == 300
    gens = id_tag(namespace, calls[0].tag, TAGS).generations
    assert client.hget(gens, "5") == b"1000"
    calls, replies = _claim(client, namespace, rids, values, [5, 4])
    assert sum(len(r[1]) for r in replies) == 300
    found = settle(calls, replies, values)
    assert found.copies == set() and found.conflicts == set()
    assert _seen_count(client, namespace, 5) == 300


@pytest.mark.redis
def test_another_origin_is_a_copy_or_with_other_content_an_id_conflict(redis_server):
    client, namespace = redis_server.client(), f"claims-copy-{os.getpid()}"
    rids = _ids(200, 3)
    _claim(client, namespace, rids, _values(200, lane=1), [5])
    values = _values(100, lane=2) + _values(100, lane=2, fingerprint=9)
    calls, replies = _claim(client, namespace, rids, values, [5])
    found = settle(calls, replies, values)
    assert found.copies == set(range(100))
    assert found.conflicts == set(range(100, 200))
    held = [
        client.hgetall(id_tag(namespace, k, TAGS).seen("src", 5, s))
        for k in range(TAGS)
        for s in range(SHARDS)
    ]
    assert all(v[:2] == (1).to_bytes(2, "big") for h in held for v in h.values())


@pytest.mark.redis
def test_an_id_claimed_in_an_older_live_generation_is_found_and_not_claimed_again(redis_server):
    client, namespace = redis_server.client(), f"claims-older-{os.getpid()}"
    rids = _ids(200, 4)
    _claim(client, namespace, rids, _values(200, lane=1), [4])
    values = _values(200, lane=2)
    calls, replies = _claim(client, namespace, rids, values, [5, 4])
    assert settle(calls, replies, values).copies == set(range(200))
    assert _seen_count(client, namespace, 5) == 0
    # A generation no longer live (GC forgets it next) is not looked in: claimed anew.
    calls, replies = _claim(client, namespace, rids, values, [6, 5])
    assert all(r[1] == [] for r in replies)
    assert _seen_count(client, namespace, 6) == 200


@pytest.mark.redis
def test_a_claim_begun_on_another_server_is_fenced_and_writes_nothing(redis_server):
    client, namespace = redis_server.client(), f"claims-fence-{os.getpid()}"
    rids = _ids(100, 5)
    run_id = client.info("server")["run_id"]
    server = {k: run_id for k in range(TAGS)}
    server[3] = "0" * 40
    calls, replies = _claim(client, namespace, rids, _values(100, 1), [5], server)
    assert {c.tag for c, r in zip(calls, replies, strict=True) if r[0] == b"fenced"} == {3}
    claimed = sum(len(c.members) for c, r in zip(calls, replies, strict=True) if r[0] == b"ok")
    assert _seen_count(client, namespace, 5) == claimed < 100
    assert client.hget(id_tag(namespace, 3, TAGS).generations, "5") is None


@pytest.mark.redis
def test_a_replayed_batch_claims_its_committed_inputs_again_before_it_runs(redis_server):
    """An ID tag's master that went back lost claims whose commits survived: the driver's
    re-mark puts them back, so a later copy is still found; a claim that survived stays."""
    client, namespace = redis_server.client(), f"claims-remark-{os.getpid()}"
    rids = _ids(120, 6)
    committed, lost = rids[:100], rids[100:]
    home = Keyspace(namespace)
    client.hset(home.backup("src", 3, 0), *inputs_args(0, committed[:60]))
    client.hset(home.backup("src", 3, 1), *inputs_args(2, committed[60:]))
    client.hset(home.backup("src", 4, 0), *inputs_args(0, lost))  # another batch
    _claim(client, namespace, committed[:10], _values(10, lane=1), [5])  # survived
    n = remark(client, namespace, TAGS, SHARDS, ["src"], 3, 5, lambda _tag: client)
    assert n == 100
    assert _seen_count(client, namespace, 5) == 100
    values = _values(120, lane=9)
    calls, replies = _claim(client, namespace, rids, values, [5])
    assert settle(calls, replies, values).copies == set(range(100))
    held = [client.hget(id_tag(namespace, k, TAGS).generations, "5") for k in range(TAGS)]
    assert all(h is not None for h in held)
