"""``rescale`` against a real Redis, on a namespace built as a run at parallelism 4 leaves it.

Every key's state and timer must land in the partition the exchange sends it to at the new
parallelism, with its value; every new partition must hold every seen-ID; counters are summed
once; what cannot be moved is refused before anything is written. The crash-and-rerun proof
with real runs is ``tests/exactly_once/test_rescale.py``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest

from onceflow.kernel.errors import ConfigError
from onceflow.kernel.key_hash import exchange_partition
from onceflow.kernel.keyspace import GC_FLOOR_FIELD, Keyspace
from onceflow.kernel.scopes import read_scopes
from onceflow.kernel.seen_layout import seen_id
from onceflow.operations.status import status
from onceflow.runtime.driver.rescale import rescale
from onceflow.runtime.driver.rescale_staging import Layout, scope_shards

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from rescale import STAGE, build  # noqa: E402

sys.path.pop(0)

pytestmark = pytest.mark.redis
KEYS, IDS = 3000, 2000


def _contents(client, namespace):
    """state {key: value}, timers {key: score}, seen-ID sets per partition, stats of p0."""
    home = Keyspace(namespace)
    scopes = read_scopes(client, home)
    shards = scope_shards(Layout(int(client.hget(home.meta, "shards")), 0), scopes.parallelism)
    state, timers, seen = {}, {}, []
    for p in range(scopes.parallelism):
        ks = scopes.keyspace(STAGE, p)
        for k, v in client.hgetall(ks.state(STAGE, p)).items():
            assert exchange_partition(k, scopes.parallelism) == p and k not in state
            state[k] = v
        for k, score in client.zrange(ks.timers("event", STAGE, p), 0, -1, withscores=True):
            assert exchange_partition(k, scopes.parallelism) == p
            timers[k] = score
        ids = set()
        for key in client.scan_iter(ks.seen_pattern()):
            q = ks.parse(key)
            ids |= {(q.generation, seen_id(f, q.shard, shards)) for f in client.hkeys(key)}
        seen.append(ids)
    stats = client.hgetall(scopes.keyspace(STAGE, 0).stats(STAGE))
    return state, timers, seen, stats


@pytest.mark.parametrize("target", [3, 8, 1])
def test_every_key_moves_to_its_new_partition_with_its_state(redis_server, target):
    client = redis_server.client()
    name = f"rescale-{target}"
    build(client, name, KEYS, IDS)
    old = read_scopes(client, Keyspace(name))
    client.hset(old.keyspace(STAGE, 1).gc, GC_FLOOR_FIELD, 1234)  # GC's floors, per scope
    client.hset(old.keyspace(STAGE, 2).gc, GC_FLOOR_FIELD, 999)
    state, timers, seen, _ = _contents(client, name)
    report = rescale(client, name, target)
    assert (report.before, report.after, report.keys) == (4, target, KEYS + KEYS // 10)
    state2, timers2, seen2, stats2 = _contents(client, name)
    assert state2 == state and len(state) == KEYS
    assert timers2 == timers and len(timers) == KEYS // 10
    everything = set().union(*seen)
    assert len(everything) == IDS and all(ids == everything for ids in seen2)
    assert stats2 == {b"records": b"400", b"duplicates": b"12"}, "summed once, into p0"
    home = Keyspace(name)
    assert client.hget(home.meta, "parallelism") == str(target).encode()
    assert json.loads(client.hget(home.meta, "plan"))["parallelism"] == target
    assert client.hget(home.meta, "rescaling") is None
    tags = {k.split(b"}")[0] for k in client.scan_iter(f"of:{{{name}:*")}
    assert len(tags) == target, "scopes past the new parallelism are gone"
    assert not list(client.scan_iter(f"of:{{{name}:*:rs*")), "nothing staged is left"
    # filters rebuild: every new partition's commit count is past every old one's
    seqs = [int(client.get(read_scopes(client, home).keyspace(STAGE, p).filter_seq(STAGE)))
            for p in range(target)]  # fmt: skip
    assert min(seqs) > 10 + 3
    new = read_scopes(client, home)
    floors = {client.hget(new.keyspace(STAGE, p).gc, GC_FLOOR_FIELD) for p in range(target)}
    assert floors == {b"1234"}, "every new partition keeps the highest GC floor"


def test_a_rescale_cut_short_while_staging_starts_over_from_the_live_keys(redis_server):
    client = redis_server.client()
    build(client, "cut", KEYS, IDS)
    state, timers, seen, _ = _contents(client, "cut")
    home = Keyspace("cut")
    # what a killed attempt to 6 leaves: its record, and garbage staged in a scope
    record = {"phase": "staging", "target": 6, "reach": 6}
    client.hset(home.meta, "rescaling", json.dumps(record))
    stray = read_scopes(client, home).keyspace(STAGE, 5)
    client.hset(f"{stray.root}:rs:st:{STAGE}:5", b"\xa4junk", b"\x01")
    said = status(client, "cut").text()
    assert "rescale under way from 4 to 6 partitions (staging)" in said, said
    rescale(client, "cut", 2)
    assert "rescale under way" not in status(client, "cut").text()
    state2, timers2, seen2, _ = _contents(client, "cut")
    assert state2 == state and timers2 == timers
    assert all(ids == set().union(*seen) for ids in seen2)


def test_what_cannot_move_is_refused_before_any_write(redis_server):
    client = redis_server.client()
    build(client, "refusals", 200, 50)
    home = Keyspace("refusals")
    scopes = read_scopes(client, home)

    def dumps():
        read = {
            b"hash": client.hgetall,
            b"zset": lambda k: client.zrange(k, 0, -1, withscores=True),
            b"string": client.get,
            b"list": lambda k: client.lrange(k, 0, -1),
        }
        keys = [*client.scan_iter("of:{refusals}:*"), *client.scan_iter("of:{refusals:*")]
        return {k: read[client.type(k)](k) for k in keys}  # this namespace's keys only

    def refused(match):
        before = dumps()
        with pytest.raises(ConfigError, match=match):
            rescale(client, "refusals", 3)
        assert dumps() == before, "a refused rescale wrote something"

    client.set(home.driver, json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    refused("a driver of namespace 'refusals' is running")
    client.delete(home.driver)
    client.set(home.acked, 4)
    client.hset(home.batch(5), "time", 1)  # started, never acknowledged, nothing committed
    backup = scopes.keyspace(STAGE, 2).backup(STAGE, 5, 2)
    client.hset(backup, "c0", b"x")  # a task of it committed a chunk
    refused("micro-batch 5 in flight: stage 'count' committed work of it")
    client.delete(backup)
    client.hset(scopes.keyspace(STAGE, 1).pending("out/delivered", 1), "marker", "x")
    refused("sink 'out/delivered' of partition 1 has a delivery pending")
    client.delete(scopes.keyspace(STAGE, 1).pending("out/delivered", 1))
    client.hset(home.state("legacy", 0), b"k", b"v")
    refused("keeps the state of 'legacy' per partition outside a partition scope")
    client.delete(home.state("legacy", 0))
    client.set(f"{scopes.keyspace(STAGE, 3).root}:mystery:1", b"?")
    refused("a rescale does not know what to do with")
    client.delete(f"{scopes.keyspace(STAGE, 3).root}:mystery:1")
    client.hset(scopes.keyspace(STAGE, 3).lanes, "t:0", 5)  # a kind scopes never hold
    refused("a rescale does not know what to do with")
    client.delete(scopes.keyspace(STAGE, 3).lanes)
    client.set(home.rescale, json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    refused("a rescale of namespace 'refusals' is under way")
    client.set(home.rescale, json.dumps({"host": socket.gethostname(), "pid": 2**22 + 7}))
    assert rescale(client, "refusals", 3).after == 3, "the lock of a process gone is taken"
    assert client.get(home.rescale) is None, "and let go"
    with pytest.raises(ConfigError, match="parallelism must be at least 1"):
        rescale(client, "refusals", 0)
    assert rescale(client, "refusals", 3).keys == 0, "the same parallelism: nothing to do"
