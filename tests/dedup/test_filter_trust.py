"""Filters that could have been trusted too early: each case made them answer "certainly
new" for IDs Redis holds in a live generation (found by review, reproduced here first).

* a snapshot taken by another worker between a task's reads of the commit count and of the
  journal shifted the journal under its offset;
* a receiver named with glob characters found none of its keys when rebuilt from Redis;
* a generation dropped from the filters because one batch no longer looked it up came back
  live when the horizon was raised;
* a snapshot of filters of another shape (the horizon changed the error rate) was read at
  the wrong bit positions.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from onceflow.connectors.kafka import KafkaSink, KafkaSource
from onceflow.dedup import trust as trust_mod
from onceflow.dedup.admission import lookup
from onceflow.dedup.batch import live_generations
from onceflow.dedup.config import DedupConfig
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.records import TaskRef
from onceflow.pipeline import Pipeline
from tests.dedup.test_guard import Harness, _copies, _rows

pytestmark = pytest.mark.redis

HOUR = 3_600_000


def _task(h, guards, batch, generation, live, partition=0):
    h.attempt_id += 1
    params = replace(h.params(batch, generation), live=tuple(live))
    ref = TaskRef(h.spec.name, batch, partition, 0, h.spec.sinks, h.attempt_id)
    g = guards.for_batch(params)(ref)
    g.open()
    return g


class _Processes:
    """Two worker processes' filter caches, swapped in and out of the module's one."""

    def __init__(self):
        self.saved = {"a": {}, "b": {}}
        self.current = None

    def enter(self, name):
        if self.current is not None:
            self.saved[self.current] = dict(trust_mod._FILTERS)
        trust_mod._FILTERS.clear()
        trust_mod._FILTERS.update(self.saved[name])
        self.current = name


def test_a_snapshot_taken_during_catch_up_cannot_shift_the_journal(redis_server, monkeypatch):
    h = Harness(redis_server, snapshot_every=1000)
    snapshot_now = replace(h.guards, config=replace(h.guards.config, snapshot_every=1))
    workers = _Processes()
    workers.enter("a")
    for i in range(5):  # commits 1..5 in worker a
        h.commit(_rows(20, 100 + i), partition=0)
    workers.enter("b")
    behind = [_rows(20, 200 + i) for i in range(5)]
    for rows in behind:  # commits 6..10 in worker b: a's filters stay at 5
        h.commit(rows, partition=1)
    workers.enter("a")
    real = trust_mod.catch_up
    raced = []

    def racing(session, receivers, *server):
        """Between a's reads at open and its catch-up: b snapshots, then commits 10 more."""
        if session.partition == 0 and not raced:
            raced.append(True)
            workers.enter("b")
            _task(h, snapshot_now, 50, 0, (0,), partition=1).close()
            for i in range(10):
                h.commit(_rows(20, 300 + i), partition=1)
            workers.enter("a")
        return real(session, receivers, *server)

    monkeypatch.setattr(trust_mod, "catch_up", racing)
    g = _task(h, h.guards, 60, 1, (1, 0), partition=0)
    copies = [r for rows in behind for r in _copies(rows, HOUR)]
    adm = g.admit(copies)
    assert raced and adm.duplicates == len(copies) and not adm.fresh


@pytest.mark.parametrize("stage", ["events[eu]", "events\\x", "events*", "ev?nts"])
def test_filters_rebuilt_from_redis_find_a_receiver_named_with_glob_characters(redis_server, stage):
    h = Harness(redis_server, snapshot_every=1000)
    p = Pipeline(h.name)
    p.read(stage, KafkaSource("in", bootstrap_servers="127.0.0.1:1")).write(
        "out", KafkaSink("out", bootstrap_servers="127.0.0.1:1")
    )
    h.spec = p.job().stages[0]
    rows = _rows(500, 7)
    h.commit(rows)
    h.client.delete(Keyspace(h.name).filter_journal(stage))  # only the seen-IDs are left
    trust_mod._FILTERS.clear()
    g = _task(h, h.guards, 9, 1, (1, 0))
    assert g.session.counters.get("bloom_rebuilds") == 1
    adm = g.admit(_copies(rows, HOUR))
    assert adm.duplicates == len(rows) and not adm.fresh


@pytest.mark.parametrize("restart", [False, True], ids=["same-worker", "restarted"])
def test_a_generation_live_again_after_the_horizon_was_raised_is_still_known(redis_server, restart):
    h = Harness(redis_server, snapshot_every=1, horizon_ms=24 * HOUR, bucket_ms=3 * HOUR)
    ks = Keyspace(h.name)
    rows = _rows(300, 1)
    g = _task(h, h.guards, 0, 0, (0,))
    assert g.commit(0, g.admit(rows).fresh, [], {}, {}) == set()
    g.close()
    newest = int(h.client.hget(ks.generations, 0))
    live = live_generations(h.client, ks, 5, newest + 1)
    assert 0 not in live, "under the old horizon generation 0 is no longer looked up"
    g = _task(h, h.guards, 1, 5, live)
    g.commit(0, g.admit(_rows(10, 2)).fresh, [], {}, {})
    g.close()  # snapshots (snapshot_every=1) while generation 0 is not live
    live = live_generations(h.client, ks, 6, newest - 1)  # the horizon was raised
    assert 0 in live
    if restart:
        trust_mod._FILTERS.clear()
    g = _task(h, h.guards, 2, 6, live)
    copies = _copies(rows, HOUR)
    assert all(
        v is not None for v in lookup(g.session, g.addressing, g.stage.name, [r[1] for r in copies])
    )
    adm = g.admit(copies)
    assert adm.duplicates == len(rows) and not adm.fresh


@pytest.mark.parametrize("horizon_h", [12, 48])
def test_a_snapshot_made_under_another_horizon_is_not_read_with_this_shape(redis_server, horizon_h):
    h = Harness(redis_server, snapshot_every=1, horizon_ms=24 * HOUR, bucket_ms=3 * HOUR)
    rows = _rows(2_000, 3)
    h.commit(rows)  # snapshotted at close
    h.commit(_rows(10, 4))  # snapshotted again: the journal keeps only this commit
    assert h.client.llen(Keyspace(h.name).filter_journal(h.spec.name)) == 1
    trust_mod._FILTERS.clear()  # the restart that brings the new horizon
    config = DedupConfig(snapshot_every=1, horizon_ms=horizon_h * HOUR, bucket_ms=3 * HOUR)
    assert trust_mod._new_filters(config).shape != trust_mod._new_filters(h.guards.config).shape
    g = _task(h, replace(h.guards, config=config), 1, 0, (0,))
    adm = g.admit(_copies(rows, 1_000))
    assert adm.duplicates == len(rows) and not adm.fresh


def test_catching_up_skips_only_the_workers_own_commits_and_trusts_the_rest(
    redis_server, monkeypatch
):
    """Two workers commit in turn: each one's filters fall behind at the other's commit,
    and catching up adds the other's IDs, not its own again (they are in already)."""
    h = Harness(redis_server, snapshot_every=1000)
    workers = _Processes()
    workers.enter("a")
    task_a = h.task(partition=0)
    workers.enter("b")
    task_b = h.task(partition=1)  # both tasks run at once, in two workers
    mine, theirs = [], []
    for i in range(3):  # a commits 1, 3, 5 and b 2, 4, 6
        mine.append(_rows(50, 400 + i))
        assert task_a.commit(i, task_a.admit(mine[-1]).fresh, [], {}, {}) == set()
        theirs.append(_rows(70, 500 + i))
        assert task_b.commit(i, task_b.admit(theirs[-1]).fresh, [], {}, {}) == set()
    task_a.close()
    task_b.close()
    workers.enter("a")
    added: list[int] = []
    real_add = trust_mod.ReceiverFilters.add

    def counting(self, ids, generation):
        added.append(len(ids) // 16 if isinstance(ids, bytes) else len(ids))
        return real_add(self, ids, generation)

    monkeypatch.setattr(trust_mod.ReceiverFilters, "add", counting)
    g, adm = h.admit([r for rows in mine + theirs for r in rows] + _rows(30, 600))
    assert sum(added) == 3 * 70, f"catch-up added {added}: a's own 150 IDs again"
    assert g.stage.trusted and g.stage.filters.seq == 6
    assert adm.duplicates == 3 * 50 + 3 * 70 and len(adm.fresh) == 30
    lookups = g.session.counters.get("redis_lookups", 0)
    assert lookups <= adm.duplicates + 1, "only 'maybe' answers ask Redis: not the 30 new ones"
