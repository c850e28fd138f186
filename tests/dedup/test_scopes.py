"""Partition scopes against a real Redis: a scoped stage partition keeps all its keys in its
own hash slot, recognises copies after a restart, fences an older driver's tasks through the
scope's copy of the epoch, and the driver folds the scopes' generations into the namespace's.
"""

from __future__ import annotations

import json
import uuid

import pytest
from redis.crc import key_slot

from onceflow.dedup import trust as trust_mod
from onceflow.dedup.batch import live_generations
from onceflow.dedup.errors import FencedError
from onceflow.dedup.guard import ExactlyOnceGuards
from onceflow.kernel import codec
from onceflow.kernel.errors import ConfigError
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.records import Output, StateWrite, TaskRef
from onceflow.kernel.scopes import (
    SCOPED_FIELD,
    Scopes,
    merge_generations,
    node_state,
    pin_scopes,
    raise_epochs,
    read_scopes,
)
from onceflow.kernel.settings import RedisSettings
from tests.dedup.test_guard import TS, Harness, _rows

pytestmark = pytest.mark.redis


class ScopedHarness(Harness):
    def __init__(self, redis_server, epoch=1, name=None, **config):
        super().__init__(redis_server, **config)
        if name is not None:
            self.name = name
        self.client.set(Keyspace(self.name).epoch, epoch)
        self.guards = ExactlyOnceGuards(
            RedisSettings(redis_server.url),
            self.name,
            epoch,
            self.guards.config,
            scoped=frozenset({self.spec.name}),
            parallelism=4,
        )
        self.scopes = Scopes(self.name, frozenset({self.spec.name}), 4)
        raise_epochs(self.scopes, epoch, lambda _tag: self.client)  # as a starting driver does


def _slot(key):
    return key_slot(key if isinstance(key, bytes) else key.encode())


def test_a_scoped_partition_keeps_every_key_it_writes_in_its_own_slot(redis_server):
    h = ScopedHarness(redis_server, snapshot_every=1)
    rows = _rows(300, 1)
    g = h.task(partition=1, batch=0, generation=4)
    adm = g.admit(rows)
    outputs = [Output(1, r[1], TS, None, b"v") for r in rows[:10]]
    state = {"count": StateWrite({codec.encode("u"): codec.encode(3)})}
    assert g.commit(0, adm.fresh, outputs, state, {}) == set()
    g.finish([], {})
    g.close()
    scope = h.scopes.keyspace(h.spec.name, 1)
    written = list(h.client.scan_iter(match=f"of:{{{h.name}*"))
    home = Keyspace(h.name)
    others = {home.epoch} | {
        ks.epoch for ks in h.scopes.partition_keyspaces() if ks.tag != scope.tag
    }  # the driver's epoch copies
    assert {k.decode() for k in written if _slot(k) != _slot(scope.root)} == others
    assert len(written) >= 8, written  # token, epoch copy, seen, journal, seq, stats, backup, state
    assert _slot(scope.root) != _slot(h.scopes.keyspace(h.spec.name, 0).root)
    assert _slot(scope.root) != _slot(home.root)
    assert int(h.client.get(scope.epoch)) == 1, "the driver copied its epoch"
    assert h.client.hget(scope.generations, 4) is not None
    assert not h.client.exists(home.generations), "the namespace's are raised by the driver"
    shards = {scope.parse(k).shard for k in written if scope.parse(k) and scope.parse(k).shard}
    assert len(shards) > 100 and max(shards) < 1024 // 4, "4 partitions share the 1024 shards"


def test_a_copy_in_a_scoped_partition_is_a_duplicate_after_the_worker_restarts(redis_server):
    h = ScopedHarness(redis_server, snapshot_every=1000)
    rows = _rows(800, 2)
    assert len(h.commit(rows, partition=0).fresh) == 800
    trust_mod._FILTERS.clear()  # the worker died: its filters are gone
    g, adm = h.admit(rows + _rows(20, 3), partition=0)
    assert adm.duplicates == 800 and len(adm.fresh) == 20
    assert g.session.counters.get("bloom_journal_entries") == 1, "the scope's own journal"


def test_an_older_drivers_tasks_are_fenced_in_every_scope_as_soon_as_a_newer_one_starts(
    redis_server,
):
    old = ScopedHarness(redis_server, epoch=1)
    zombie = old.task(partition=0, batch=5)
    ScopedHarness(redis_server, epoch=2, name=old.name)  # a newer driver starts: no task yet
    rows = _rows(10, 4)
    with pytest.raises(FencedError, match="newer driver"):
        zombie.commit(0, zombie.admit(rows).fresh, [], {}, {})
    late = old.guards.for_batch(old.params(5))(TaskRef(old.spec.name, 5, 3, 0, (), 99))
    with pytest.raises(FencedError, match="newer driver"):
        late.open()  # partition 3: no task of the newer driver has touched it
    new = ScopedHarness(redis_server, epoch=2, name=old.name)
    live = new.task(partition=0, batch=5, attempt_id=1)  # Spark's ids restart with a driver
    assert live.commit(0, live.admit(rows).fresh, [], {}, {}) == set(), "the live one goes on"


def test_a_leftover_task_cannot_claim_a_scope_no_driver_set_up(redis_server):
    """After a reset the epoch starts again at 1: an old run's task (epoch 5) is refused."""
    h = ScopedHarness(redis_server, epoch=1)
    h.client.delete(h.scopes.keyspace(h.spec.name, 2).epoch)  # as a reset leaves it
    stale = ExactlyOnceGuards(
        RedisSettings(redis_server.url),
        h.name,
        5,
        h.guards.config,
        scoped=frozenset({h.spec.name}),
        parallelism=4,
    )
    task = stale.for_batch(h.params(0))(TaskRef(h.spec.name, 0, 2, 0, (), 1))
    with pytest.raises(FencedError, match="newer driver"):
        task.open()
    assert h.client.get(h.scopes.keyspace(h.spec.name, 2).epoch) is None, "nothing was set"
    h.client.set(h.scopes.keyspace(h.spec.name, 1).epoch, 7)  # state of another run
    with pytest.raises(ConfigError, match="onceflow reset"):
        raise_epochs(h.scopes, 1, lambda _tag: h.client)


def test_the_driver_folds_scope_generations_into_the_namespaces(redis_server):
    h = ScopedHarness(redis_server)
    h.commit(_rows(50, 5), partition=0, generation=7)
    h.commit(_rows(50, 6), partition=1, generation=9)
    home = Keyspace(h.name)
    assert live_generations(h.client, home, 10, 0) == (10,), "not merged yet"
    connect = lambda _tag: h.client  # noqa: E731 - one Redis serves every tag
    assert merge_generations(h.client, h.scopes, connect) == 2
    assert live_generations(h.client, home, 10, 0) == (10, 9, 7)
    assert merge_generations(h.client, h.scopes, connect) == 0, "a replayed merge changes nothing"


def test_scopes_are_fixed_for_new_namespaces_and_a_stage_cannot_change_place(redis_server):
    client = redis_server.client()
    fresh = Keyspace(f"scopes-{uuid.uuid4().hex[:6]}")
    stages = ["events", "count"]
    assert pin_scopes(client, fresh, ["count"], stages, frozenset(), 2, True).stages == {"count"}
    assert read_scopes(client, fresh).stages == {"count"}
    before = frozenset(stages)
    grown = pin_scopes(client, fresh, ["count", "windows"], [*stages, "windows"], before, 2, False)
    assert grown.stages == {"count", "windows"}, "a changed plan's new exchange stage is scoped"
    with pytest.raises(ConfigError, match="follow a key exchange"):  # events is a keyed stage now
        pin_scopes(client, fresh, ["count", "events"], stages, before, 2, False)
    with pytest.raises(ConfigError, match="'count'"):  # count no longer follows an exchange
        pin_scopes(client, fresh, [], stages, before, 2, False)
    gone = pin_scopes(client, fresh, ["windows"], ["events", "windows"], before, 2, False)
    assert "count" in gone.stages, "a removed stage's scopes stay known (for GC and reset)"
    older = Keyspace(f"scopes-old-{uuid.uuid4().hex[:6]}")
    client.hset(older.meta, "parallelism", 2)  # made by an Onceflow without scopes
    assert pin_scopes(client, older, ["count"], stages, before, 2, False).stages == frozenset()
    assert client.hget(older.meta, SCOPED_FIELD) is None


def test_node_state_reads_every_partition_where_the_plan_put_it(redis_server):
    client = redis_server.client()
    ks = Keyspace(f"scopes-state-{uuid.uuid4().hex[:6]}")
    plan = {"stages": {"events": ["events", "parse"], "agg": ["key", "count"]}, "parallelism": 2}
    client.hset(ks.meta, mapping={"parallelism": 2, "plan": json.dumps(plan)})
    client.hset(ks.meta, SCOPED_FIELD, json.dumps(["agg"]))
    scopes = read_scopes(client, ks)
    for p in range(2):
        client.hset(scopes.keyspace("agg", p).state("count", p), f"k{p}", p)
    client.hset(ks.state("count", 0), "stray", 1)  # the namespace's tag: not where it lives
    assert node_state(client, ks.namespace, "count") == {b"k0": b"0", b"k1": b"1"}
