"""Receivers' trust in their Bloom filters, against a real Redis.

A filter that is new, restarted (the worker process died) or moved (another worker committed
meanwhile) must never answer "not seen" for IDs it has not covered: it is caught up from the
journal or the snapshot first. Each test commits IDs, then takes the filters away or makes
them stale, and checks that every committed ID is still recognised as a duplicate.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from onceflow.connectors.kafka import KafkaSink, KafkaSource
from onceflow.dedup import trust as trust_mod
from onceflow.dedup.config import DedupConfig
from onceflow.dedup.guard import ExactlyOnceGuards
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.records import TaskRef
from onceflow.kernel.settings import RedisSettings
from onceflow.pipeline import Pipeline

pytestmark = pytest.mark.redis

TS = 1_790_000_000_000


def _spec(name):
    p = Pipeline(name)
    p.read("events", KafkaSource("in", bootstrap_servers="127.0.0.1:1")).map(
        "same", lambda e: e
    ).write("out", KafkaSink("out", bootstrap_servers="127.0.0.1:1"))
    return p.job().stages[0]


def _rows(n, seed):
    rng = np.random.default_rng(seed)
    return [
        (0, bytes(r), TS + i, None, {"i": i})
        for i, r in enumerate(rng.integers(0, 256, (n, 16), dtype=np.uint8))
    ]


class Harness:
    def __init__(self, redis_server, **config):
        self.name = f"trust-{uuid.uuid4().hex[:8]}"
        self.client = redis_server.client()
        self.client.incr(Keyspace(self.name).epoch)
        self.guards = ExactlyOnceGuards(
            RedisSettings(redis_server.url), self.name, 1, DedupConfig(**config)
        )
        self.spec = _spec(self.name)
        self.batch = 0

    def task(self, partition=0):
        g = self.guards(TaskRef(self.spec.name, self.batch, partition, 0, self.spec.sinks))
        self.batch += 1
        g.open()
        return g

    def commit(self, rows, partition=0):
        g = self.task(partition)
        adm = g.admit(rows)
        assert g.commit(0, adm.fresh, [], {}) == set()
        g.close()
        return adm

    def admit(self, rows, partition=0):
        g = self.task(partition)
        adm = g.admit(rows)
        return g, adm


def test_a_restarted_worker_rebuilds_its_filters_before_trusting_them(redis_server):
    h = Harness(redis_server, snapshot_every=1000)
    old = _rows(3000, 1)
    assert len(h.commit(old).fresh) == 3000
    trust_mod._FILTERS.clear()  # the worker process died: its filters are gone
    g, adm = h.admit(old + _rows(500, 2))
    assert adm.duplicates == 3000 and len(adm.fresh) == 500
    assert g.session.counters.get("bloom_journal_entries") == 1, "caught up from the journal"


def test_filters_are_loaded_from_the_snapshot(redis_server):
    h = Harness(redis_server, snapshot_every=2)
    batches = [_rows(400, 10 + i) for i in range(5)]
    for rows in batches:
        h.commit(rows)
    ks = Keyspace(h.name)
    assert h.client.hget(ks.filter_snapshot(h.spec.name, 0), "seq") is not None
    assert h.client.llen(ks.filter_journal(h.spec.name, 0)) < 5, "a snapshot trims the journal"
    trust_mod._FILTERS.clear()
    g, adm = h.admit([r for rows in batches for r in rows])
    assert adm.duplicates == 2000 and not adm.fresh
    assert g.session.counters.get("bloom_loaded_snapshots") == 1


def test_a_stale_filter_moved_between_workers_catches_up(redis_server):
    h = Harness(redis_server, snapshot_every=1000)
    h.commit(_rows(100, 20))
    key = (h.name, h.spec.name, 0)
    stale = trust_mod._FILTERS[key]  # this worker's filters, at commit 1
    stale_seq = stale.seq
    trust_mod._FILTERS.clear()
    later = _rows(700, 21)
    h.commit(later)  # "another worker" commits to the same receiver partition
    trust_mod._FILTERS[key] = stale  # the task comes back to the first worker
    assert stale.seq == stale_seq
    g, adm = h.admit(later)
    assert adm.duplicates == 700, "a stale filter answered 'not seen' for IDs it never covered"
    assert stale.seq > stale_seq


def test_without_journal_or_snapshot_the_filters_are_rebuilt_from_redis(redis_server):
    h = Harness(redis_server, snapshot_every=1000)
    rows = _rows(800, 30)
    h.commit(rows)
    ks = Keyspace(h.name)
    h.client.delete(ks.filter_journal(h.spec.name, 0))  # e.g. lost or trimmed elsewhere
    trust_mod._FILTERS.clear()
    g, adm = h.admit(rows)
    assert adm.duplicates == 800
    assert g.session.counters.get("bloom_rebuilds") == 1
