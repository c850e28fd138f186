"""The exactly-once guard against a real Redis: trust in Bloom filters, copies across
generations and partitions, concurrent commits, and task attempts that start late.

A filter that is new, restarted (the worker process died) or moved (another worker committed
meanwhile) must never answer "not seen" for IDs it has not covered: it is caught up from the
journal or the snapshot first. Each test commits IDs, then takes the filters away or makes
them stale, and checks that every committed ID is still recognised as a duplicate.
"""

from __future__ import annotations

import uuid
from dataclasses import replace

import numpy as np
import pytest

from onceflow.connectors.kafka import KafkaSink, KafkaSource
from onceflow.dedup import trust as trust_mod
from onceflow.dedup.batch import BatchParams
from onceflow.dedup.config import DedupConfig
from onceflow.dedup.delivery import SinkState
from onceflow.dedup.errors import FencedError
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
        self.attempt_id = 0

    def params(self, batch, generation=0, floor=0):
        """Every generation up to ``generation`` is live (their events are all recent)."""
        hour = 3_600_000
        live = tuple(range(generation, -1, -1))
        return BatchParams(
            batch,
            TS,
            TS,
            generation * hour,
            24 * hour,
            floor,
            generation,
            live,
            TS * 2,
        )

    def task(self, partition=0, batch=None, generation=0, attempt_id=None):
        if batch is None:
            batch = self.batch
            self.batch += 1
        if attempt_id is None:
            self.attempt_id += 1
            attempt_id = self.attempt_id
        ref = TaskRef(self.spec.name, batch, partition, 0, self.spec.sinks, attempt_id)
        g = self.guards.for_batch(self.params(batch, generation))(ref)
        g.open()
        return g

    def commit(self, rows, partition=0, generation=0):
        g = self.task(partition, generation=generation)
        adm = g.admit(rows)
        assert g.commit(0, adm.fresh, [], {}, {}) == set()
        g.close()
        return adm

    def admit(self, rows, partition=0, generation=0):
        g = self.task(partition, generation=generation)
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
    assert h.client.hget(ks.filter_snapshot(h.spec.name), "seq") is not None
    assert h.client.llen(ks.filter_journal(h.spec.name)) < 5, "a snapshot trims the journal"
    trust_mod._FILTERS.clear()
    g, adm = h.admit([r for rows in batches for r in rows])
    assert adm.duplicates == 2000 and not adm.fresh
    assert g.session.counters.get("bloom_loaded_snapshots") == 1


def test_a_stale_filter_moved_between_workers_catches_up(redis_server):
    h = Harness(redis_server, snapshot_every=1000)
    h.commit(_rows(100, 20))
    key = (h.name, h.spec.name)
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
    h.client.delete(ks.filter_journal(h.spec.name))  # e.g. lost or trimmed elsewhere
    trust_mod._FILTERS.clear()
    g, adm = h.admit(rows)
    assert adm.duplicates == 800
    assert g.session.counters.get("bloom_rebuilds") == 1


def _copies(rows, shift_ms):
    """The same records (same IDs) with other event times, as a re-send would carry."""
    return [(i, rid, ts + shift_ms, kb, elem) for i, rid, ts, kb, elem in rows]


def test_a_copy_with_another_timestamp_in_a_later_generation_is_a_duplicate(redis_server):
    h = Harness(redis_server, snapshot_every=1000)
    rows = _rows(500, 40)
    h.commit(rows, generation=5)
    g, adm = h.admit(_copies(rows, 2 * 3_600_000) + _rows(50, 41), generation=7)
    assert adm.duplicates == 500 and len(adm.fresh) == 50


def test_a_copy_arriving_in_another_partition_is_a_duplicate_even_in_a_fresh_worker(redis_server):
    h = Harness(redis_server, snapshot_every=1000)
    rows = _rows(300, 42)
    h.commit(rows, partition=0, generation=2)
    trust_mod._FILTERS.clear()  # the other partition runs in another worker process
    g, adm = h.admit(_copies(rows, -60_000), partition=1, generation=3)
    assert adm.duplicates == 300 and not adm.fresh


def test_copies_committed_concurrently_by_two_partitions_conflict(redis_server):
    h = Harness(redis_server, snapshot_every=1000)
    rows = _rows(200, 43)
    a = h.task(partition=0, batch=9)
    b = h.task(partition=1, batch=9)
    fresh_a = a.admit(rows).fresh
    fresh_b = b.admit(_copies(rows, 5_000)).fresh
    assert len(fresh_a) == len(fresh_b) == 200, "neither has seen the other's rows yet"
    assert a.commit(0, fresh_a, [], {}, {}) == set()
    conflicts = b.commit(0, fresh_b, [], {}, {})
    assert conflicts == {r[1] for r in rows}, "the second commit of the same IDs is refused"


def test_an_id_only_an_expired_generation_seemed_to_hold_stays_known_after_it_expires(redis_server):
    """A false positive of an older generation's filter sends an ID to Redis, which says
    unseen: the ID is committed in the batch's generation, and that generation's filter must
    hold it too. Otherwise, once the older generation is no longer live, the filters would
    answer "certainly new" for a copy, and Redis would never be asked."""
    h = Harness(redis_server, snapshot_every=1000)
    rows = _rows(50, 45)
    g = h.task(batch=1, generation=2)  # live: 2, 1, 0
    g.stage.filters.add([r[1] for r in rows], 1)  # bits set in generation 1, as by chance
    adm = g.admit(rows)
    assert len(adm.fresh) == len(rows), "Redis says they are new"
    assert g.commit(0, adm.fresh, [], {}, {}) == set()
    g.close()
    later = replace(h.params(2, 3), live=(3, 2))  # generation 1 has expired
    ref = TaskRef(h.spec.name, 2, 0, 0, h.spec.sinks, 99)
    g2 = h.guards.for_batch(later)(ref)
    g2.open()
    adm = g2.admit(_copies(rows, 60_000))
    assert adm.duplicates == len(rows) and not adm.fresh


def _stored_seen(h):
    """How many seen-marks the namespace holds, read from Redis itself (HLEN of every shard)."""
    ks = Keyspace(h.name)
    return sum(h.client.hlen(k) for k in h.client.scan_iter(match=ks.seen_pattern(), count=1000))


def test_a_chunk_with_copies_scattered_over_many_shards_names_each_and_leaves_nothing(redis_server):
    """Fields travel grouped by shard; conflicts must still name the right rows, and a
    refused chunk must leave none of its marks behind (the redo writes them)."""
    h = Harness(redis_server, snapshot_every=1000)
    rows = _rows(6_000, 44)  # thousands of shards touched, several IDs in most
    taken = rows[::7] + rows[3::997]
    a = h.task(partition=0, batch=9)
    b = h.task(partition=1, batch=9)
    fresh_b = b.admit(rows).fresh
    assert len(fresh_b) == len(rows)
    assert a.commit(0, a.admit(taken).fresh, [], {}, {}) == set()
    assert _stored_seen(h) == len({r[1] for r in taken})
    conflicts = b.commit(0, fresh_b, [], {}, {})
    assert conflicts == {r[1] for r in taken}
    assert _stored_seen(h) == len({r[1] for r in taken}), "the refused chunk left marks"
    redo = [r for r in fresh_b if r[1] not in conflicts]
    assert b.commit(0, redo, [], {}, {}) == set()
    assert _stored_seen(h) == len(rows)
    trust_mod._FILTERS.clear()
    _, adm = h.admit(rows, partition=0)
    assert adm.duplicates == len(rows) and not adm.fresh


def test_an_older_attempt_that_starts_late_is_fenced_and_cannot_commit(redis_server):
    h = Harness(redis_server, snapshot_every=1000)
    live = h.task(partition=0, batch=3, attempt_id=20)
    ref = TaskRef(h.spec.name, 3, 0, 0, h.spec.sinks, 12)  # an older attempt, waking up late
    zombie = h.guards.for_batch(h.params(3))(ref)
    with pytest.raises(FencedError, match="newer task"):
        zombie.open()
    rows = _rows(10, 44)
    assert live.commit(0, live.admit(rows).fresh, [], {}, {}) == set(), "the live one goes on"


def _outputs(n, seed):
    from onceflow.kernel.records import Output

    return [Output(1, rid, TS, None, b"v") for _i, rid, _ts, _kb, _e in _rows(n, seed)]


@pytest.mark.parametrize("committed", [True, False])
def test_a_delivery_left_pending_is_resolved_by_the_next_attempt(redis_server, committed):
    """Transactional: committed -> never sent again; aborted -> sent again, no copy counted."""
    h = Harness(redis_server, snapshot_every=1000)
    sink = h.spec.sinks[0][0]
    outs = _outputs(300, 50)
    first = h.task(partition=0, batch=4)
    assert first.undelivered(sink, outs) == outs
    first.prepare_delivery(sink, "log|0|17|4.0.1.0", outs)  # then killed before the marks
    trust_mod._FILTERS.clear()  # the next attempt runs in another worker process
    again = h.task(partition=0, batch=4)
    left = again.sink_state(sink).pending
    assert left is not None and left.marker == "log|0|17|4.0.1.0" and len(left.ids) == 300
    again.resolve_pending(sink, left, committed)
    assert again.sink_state(sink).pending is None
    todo = again.undelivered(sink, outs)
    assert todo == ([] if committed else outs)
    trust_mod._FILTERS.clear()  # and a fresh worker agrees
    assert h.task(partition=0, batch=4).undelivered(sink, outs) == todo


def test_writers_are_recorded_until_their_delivery_is_marked(redis_server):
    """A transactional writer is recorded before it begins; marking the delivery forgets it."""
    h = Harness(redis_server, snapshot_every=1000)
    sink = h.spec.sinks[0][0]
    outs = _outputs(50, 52)
    first = h.task(partition=0, batch=5, attempt_id=30)
    assert first.sink_state(sink).writers == ()
    first.note_writer(sink, "onceflow.p.out.aaaa")
    first.note_writer(sink, "onceflow.p.out.aaaa")  # the same writer, again: once
    first.prepare_delivery(sink, "log|0|3|5.0.30.0", outs)
    left = h.task(partition=0, batch=5, attempt_id=31).sink_state(sink)  # killed: a retry
    assert left.writers == ("onceflow.p.out.aaaa",)
    assert left.pending is not None and left.pending.marker == "log|0|3|5.0.30.0"

    retry = h.task(partition=0, batch=5, attempt_id=32)
    retry.sink_state(sink)
    retry.resolve_pending(sink, left.pending, False)
    assert retry.sink_state(sink) == SinkState(), "resolving forgets the settled writers"
    retry.note_writer(sink, "onceflow.p.out.bbbb")
    assert retry.sink_state(sink).writers == ("onceflow.p.out.bbbb",)
    retry.note_writer(sink, "onceflow.p.out.bbbb", begins=False)  # aborted before a marker
    assert retry.sink_state(sink).writers == ()
    retry.note_writer(sink, "onceflow.p.out.bbbb")
    retry.prepare_delivery(sink, "log|0|9|5.0.32.0", outs)
    retry.delivered(sink, outs)
    assert retry.sink_state(sink) == SinkState(), "a marked delivery leaves nothing to settle"


def test_an_older_attempt_cannot_record_a_writer(redis_server):
    h = Harness(redis_server, snapshot_every=1000)
    sink = h.spec.sinks[0][0]
    older = h.task(partition=1, batch=6, attempt_id=40)
    h.task(partition=1, batch=6, attempt_id=41)  # Spark re-ran it: the newer one claimed it
    with pytest.raises(FencedError):
        older.note_writer(sink, "onceflow.p.out.zzzz")
    assert h.task(partition=1, batch=6, attempt_id=42).sink_state(sink).writers == ()


def test_a_plain_delivery_left_pending_counts_its_possible_copies(redis_server):
    from onceflow.dedup.delivery import NO_MARKER

    h = Harness(redis_server, snapshot_every=1000)
    sink = h.spec.sinks[0][0]
    outs = _outputs(120, 51)
    h.task(partition=1, batch=2).prepare_delivery(sink, NO_MARKER, outs)
    again = h.task(partition=1, batch=2)
    again.resolve_pending(sink, again.sink_state(sink).pending, False)
    assert again.undelivered(sink, outs) == outs, "a plain sink cannot tell: write again"
    stats = h.client.hgetall(Keyspace(h.name).stats("out/delivered"))
    assert int(stats[b"possible_copies"]) == 120


def _seen_ids_in_redis(h, receiver):
    """Seen-marks of a receiver, counted in Redis (every generation and shard)."""
    ks = Keyspace(h.name)
    return sum(h.client.hlen(k) for k in h.client.scan_iter(match=ks.seen_pattern(receiver)))


def test_positional_ids_take_no_seen_mark_and_a_retry_knows_them_from_the_backup(redis_server):
    """Positions are read by one task per micro-batch: its backup is their only memory."""
    h = Harness(redis_server)
    positions, keyed = _rows(300, 41), _rows(100, 42)
    flags = [True] * 300 + [False] * 100
    first = h.task(batch=0)
    adm = first.admit(positions + keyed, flags)
    assert len(adm.fresh) == 400 and adm.unmarked == {r[1] for r in positions}
    assert first.commit(0, adm.fresh, [], {}, {}, adm.unmarked) == set()
    assert _seen_ids_in_redis(h, h.spec.name) == 100, "only the ordinary IDs are marked seen"
    journal = h.client.lrange(Keyspace(h.name).filter_journal(h.spec.name), 0, -1)
    assert len(journal) == 1 and len(trust_mod.msgpack.unpackb(journal[0])[0][1]) == 100 * 16

    trust_mod._FILTERS.clear()  # the retry runs in another worker
    retry = h.task(batch=0)
    again = retry.admit(positions + keyed, flags)
    assert len(again.replayed) == 400 and not again.fresh and again.duplicates == 0

    later = h.task(batch=1)  # another batch never reads these positions again; IDs are copies
    other = later.admit(keyed + _rows(50, 43), [False] * 150)
    assert other.duplicates == 100 and len(other.fresh) == 50
