"""The seen-ID layout against a real Redis.

Each seen ID is stored as what its shard does not already say, with a constant value; a task
attempt learns what earlier attempts of the task committed from its backup, and what they
delivered from the backup's delivery log. These tests check that it stores what it claims,
that replays, copies and conflicts are decided right, that IDs which differ only in the bytes
that pick their shard are never confused, and that a namespace an older Onceflow made in
another layout is refused with the way out.
"""

from __future__ import annotations

import uuid

import pytest

from onceflow.backup.format import DONE, chunk_field, encode_outputs, inputs_field
from onceflow.backup.store import replay
from onceflow.dedup import trust as trust_mod
from onceflow.dedup.batch import fix_batch_params, read_batch_params
from onceflow.dedup.config import DedupConfig
from onceflow.kernel.errors import ConfigError
from onceflow.kernel.eventtime import EventTime
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.records import Output, TaskRef
from onceflow.kernel.seen_layout import LAYOUT, LAYOUT_FIELD, SEEN_MARK, seen_id
from onceflow.runtime.driver.pinning import pin_layout, pin_settings
from tests.dedup.test_guard import TS, Harness, _rows

pytestmark = pytest.mark.redis

SHARDS = 1024


def _seen(h, receiver):
    """Every seen-mark of a receiver: {(shard, field): value}."""
    ks = Keyspace(h.name)
    found = {}
    for key in h.client.scan_iter(match=ks.seen_pattern(receiver), count=1000):
        shard = ks.parse(key).shard
        for f, v in h.client.hgetall(key).items():
            found[(shard, f)] = v
    return found


def _attempt(h, batch, partition, attempt_id):
    """A task attempt, opened: the guard and what its backup said."""
    ref = TaskRef(h.spec.name, batch, partition, 0, h.spec.sinks, attempt_id)
    g = h.guards.for_batch(h.params(batch))(ref)
    return g, g.open()


def _ids(rows):
    return {r[1] for r in rows}


def _with_prefix(prefix, tail):
    return (0, prefix.to_bytes(2, "big") + tail, TS, None, {"p": prefix})


def test_seen_ids_are_short_fields_with_a_constant_and_the_inputs_are_in_the_backup(redis_server):
    h = Harness(redis_server, snapshot_every=1000)
    rows = _rows(3000, 60)
    g, _ = _attempt(h, 3, 0, 1)
    assert g.commit(0, g.admit(rows).fresh, [], {}, {}) == set()
    seen = _seen(h, h.spec.name)
    assert {len(f) for _s, f in seen} == {15} and set(seen.values()) == {SEEN_MARK}
    assert {seen_id(f, s, SHARDS) for s, f in seen} == _ids(rows)
    backup = h.client.hgetall(Keyspace(h.name).backup(h.spec.name, 3, 0))
    assert backup[inputs_field(0).encode()] == b"".join(r[1] for r in rows)
    assert replay(backup).inputs == _ids(rows)

    later = h.task(batch=4)  # a later batch: every row is a copy now
    assert later.admit(rows).duplicates == 3000


def test_a_backup_without_input_fields_replays_no_inputs():
    fields = {chunk_field(0).encode(): encode_outputs([]), DONE.encode(): b"1"}
    assert replay(fields).inputs == frozenset() and replay(fields).done


@pytest.mark.parametrize("fresh_worker", [False, True])
def test_a_retried_attempt_replays_what_earlier_attempts_committed(redis_server, fresh_worker):
    """Replayed, copies, fresh, chunk after chunk."""
    h = Harness(redis_server, snapshot_every=1000)
    elsewhere, first, second, new = (_rows(n, 70 + i) for i, n in enumerate((50, 300, 200, 40)))
    h.commit(elsewhere, partition=1)  # batch 0: another task committed these

    g1, _ = _attempt(h, 5, 0, 10)
    assert g1.commit(0, g1.admit(first).fresh, [], {}, {}) == set()
    adm = g1.admit(second + first[:5])
    assert len(adm.fresh) == 200 and adm.duplicates == 5, "this attempt's own rows are copies"
    assert g1.commit(1, adm.fresh, [], {}, {}) == set()  # ... and then it dies

    if fresh_worker:
        trust_mod._FILTERS.clear()
    g2, backup = _attempt(h, 5, 0, 11)
    assert backup.next_chunk == 2
    assert backup.inputs == _ids(first + second)
    adm = g2.admit(first + second + elsewhere + first[:3] + new)
    assert (len(adm.replayed), adm.duplicates, len(adm.fresh)) == (500, 53, 40)
    assert _ids(adm.replayed) == _ids(first + second) and adm.fresh == new
    assert g2.commit(2, adm.fresh, [], {}, {}) == set()
    adm = g2.admit(first[:4] + new[:2])  # a later chunk of the same attempt
    assert (len(adm.replayed), adm.duplicates, len(adm.fresh)) == (4, 2, 0)


def test_a_copy_committed_by_another_task_of_the_batch_conflicts_and_no_neighbour_does(
    redis_server,
):
    """IDs differing only in the bytes that pick their shard: same shard, or another."""
    h = Harness(redis_server, snapshot_every=1000)
    tail = bytes(range(14))
    x, same_shard, other_shard = (_with_prefix(p, tail) for p in (1, 1 + SHARDS, 2))
    a, _ = _attempt(h, 9, 0, 1)
    b, _ = _attempt(h, 9, 1, 2)
    fresh_a = a.admit([x]).fresh
    fresh_b = b.admit([same_shard, other_shard, x]).fresh
    assert len(fresh_b) == 3, "b has not seen a's row yet"
    assert a.commit(0, fresh_a, [], {}, {}) == set()
    assert b.commit(0, fresh_b, [], {}, {}) == {x[1]}, "only the true copy conflicts"
    assert b.commit(0, [same_shard, other_shard], [], {}, {}) == set(), "the redo commits"
    trust_mod._FILTERS.clear()
    never = _with_prefix(1 + 2 * SHARDS, tail)
    adm = h.task(batch=10).admit([x, same_shard, other_shard, never])
    assert adm.duplicates == 3 and adm.fresh == [never]


def test_ids_sharing_a_tail_are_told_apart_even_by_filters_rebuilt_from_redis(redis_server):
    """64 prefixes per shard share each tail; half of them are committed."""
    h = Harness(redis_server, snapshot_every=1000)
    tails = [bytes(14), b"\xab" * 14]
    prefixes = [s + SHARDS * k for s in (0, 1, 1023) for k in range(64)]
    rows = [_with_prefix(p, t) for t in tails for p in prefixes]
    committed = [r for r in rows if (int.from_bytes(r[1][:2], "big") // SHARDS) % 2 == 0]
    h.commit(committed)
    ks = Keyspace(h.name)
    h.client.delete(ks.filter_journal(h.spec.name))  # the filters must come from the seen-IDs
    trust_mod._FILTERS.clear()
    g, adm = h.admit(rows)
    assert g.session.counters.get("bloom_rebuilds") == 1
    assert adm.duplicates == len(committed) == len(rows) // 2
    assert _ids(adm.fresh) == _ids(rows) - _ids(committed)


def _older_namespace(client, layout=None):
    """The meta hash an older Onceflow left (``layout`` None: one without layouts)."""
    ks = Keyspace(f"layout-{uuid.uuid4().hex[:8]}")
    client.hset(ks.meta, mapping={"parallelism": 1, "bucket_ms": 3 * 3_600_000, "shards": SHARDS})
    if layout is not None:
        client.hset(ks.meta, LAYOUT_FIELD, layout)
    client.set(ks.epoch, 1)
    return ks


@pytest.mark.parametrize(
    ("layout", "commit"), [(None, "7c48c6f"), (1, "7c48c6f"), (2, "7c48c6f"), (4, "5e4ab38")]
)
def test_a_namespace_an_older_onceflow_made_is_refused_with_the_way_out(
    redis_server, layout, commit
):
    client = redis_server.client()
    ks = _older_namespace(client, layout)
    with pytest.raises(ConfigError) as refused:
        pin_settings(client, ks, 1, DedupConfig.of(horizon="24h", bucket="3h"))
    said = str(refused.value)
    assert "\n" not in said
    assert f"namespace {ks.namespace!r} was made by an older version of onceflow" in said
    assert f"(seen-ID layout {layout or 1})" in said
    assert f"onceflow reset --namespace {ks.namespace} --checkpoint" in said
    assert f"at commit {commit}" in said
    assert client.hget(ks.meta, LAYOUT_FIELD) == (None if layout is None else str(layout).encode())


def test_a_new_namespace_gets_the_layout_and_keeps_it(redis_server):
    client = redis_server.client()
    ks = Keyspace(f"layout-{uuid.uuid4().hex[:8]}")
    pin_settings(client, ks, 2, DedupConfig())
    assert client.hget(ks.meta, LAYOUT_FIELD) == str(LAYOUT).encode() == b"3"
    client.set(ks.epoch, 1)
    pin_layout(client, ks)  # state now, and the layout stays
    assert client.hget(ks.meta, LAYOUT_FIELD) == b"3"
    fix_batch_params(client, ks, 1, 0, DedupConfig(), EventTime())
    assert read_batch_params(client, ks, 0) is not None


def test_a_layout_this_onceflow_does_not_know_is_refused(redis_server):
    client = redis_server.client()
    ks = _older_namespace(client, 9)
    with pytest.raises(ConfigError, match="layout 9, which this onceflow does not know"):
        pin_settings(client, ks, 1, DedupConfig.of(horizon="24h", bucket="3h"))


def test_each_delivery_is_logged_in_the_backup_of_the_task_and_marks_nothing(redis_server):
    """Only an attempt of the delivering task can deliver its records again: it reads the log."""
    h = Harness(redis_server, snapshot_every=1000)
    sink = h.spec.sinks[0][0]
    first_outs = [Output(1, r[1], TS, None, b"v") for r in _rows(500, 61)]
    second_outs = [Output(1, r[1], TS, None, b"w") for r in _rows(200, 62)]
    g, _ = _attempt(h, 3, 0, 1)
    for outs, marker in ((first_outs, "m1"), (second_outs, "m2")):
        assert g.undelivered(sink, outs) == outs
        g.prepare_delivery(sink, marker, outs)
        g.delivered(sink, outs)
    assert _seen(h, "out/delivered") == {}, "no seen-ID per delivered record"
    ks = Keyspace(h.name)
    backup = h.client.hgetall(ks.backup(h.spec.name, 3, 0))
    assert backup[b"dl:1:out"] == b"".join(o.id for o in first_outs)
    assert backup[b"dl:2:out"] == b"".join(o.id for o in second_outs)
    assert replay(backup).delivered == {"out": {o.id for o in first_outs + second_outs}}
    assert int(h.client.hget(ks.stats("out/delivered"), "delivered")) == 700
    assert g.sink_state(sink).pending is None

    trust_mod._FILTERS.clear()  # the retry runs in another worker
    retry, _ = _attempt(h, 3, 0, 2)
    new = [Output(1, r[1], TS, None, b"x") for r in _rows(30, 63)]
    assert retry.undelivered(sink, second_outs + new + first_outs) == new
    other, _ = _attempt(h, 3, 1, 3)  # another task never made these records
    assert other.undelivered(sink, first_outs) == first_outs


def test_a_pending_delivery_of_an_older_batch_is_logged_in_its_own_backup(redis_server):
    h = Harness(redis_server, snapshot_every=1000)
    sink = h.spec.sinks[0][0]
    outs = [Output(1, r[1], TS, None, b"v") for r in _rows(40, 64)]
    g, _ = _attempt(h, 7, 0, 1)
    g.prepare_delivery(sink, "m", outs)  # then the attempt died
    later, _ = _attempt(h, 8, 0, 2)
    left = later.sink_state(sink).pending
    assert left is not None and left.batch == 7
    later.resolve_pending(sink, left, True)
    ks = Keyspace(h.name)
    assert replay(h.client.hgetall(ks.backup(h.spec.name, 7, 0))).delivered == {
        "out": {o.id for o in outs}
    }
    assert later.sink_state(sink).pending is None
