"""Keyed state with a time-to-live: idle keys start afresh, and GC reclaims them while the
pipeline's state stays consistent.

Users u0..u9 send events; after the time-to-live only u0..u4 send again: their counts must
start from zero (the old state expired by batch time), and ``onceflow gc`` must delete the
state of u5..u9 (and only theirs). A commit that updates a key after GC read its expiry
keeps the key: the deleting script re-checks.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections import Counter, defaultdict
from functools import partial

import pytest

from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import produce, read_topic
from onceflow.kernel import codec, ids
from onceflow.kernel.keyspace import Keyspace, Kind
from onceflow.kernel.scopes import read_scopes
from onceflow.kernel.scripts import scripts_for
from onceflow.operations.gc import collect
from onceflow.operations.status import status
from onceflow.testing.harness import Crash, run_pipeline

pytestmark = [pytest.mark.kafka, pytest.mark.redis]

PIPELINE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "e2e_pipelines", "ttl.py")
TTL_S = 4


def _send(settings, topic, users, each):
    """``each`` events of every user, each with its own ID."""
    events = [{"event_id": str(uuid.uuid4()), "user": u} for u in users for _ in range(each)]
    produce(settings, topic, [(None, json.dumps(e).encode(), None) for e in events])


def _state(client, ks):
    """Every (state hash, expiry set) pair of the namespace, decoded: user -> count."""
    counts, expiries = {}, {}
    for tag in read_scopes(client, ks).keyspaces():
        for key in client.scan_iter(match=tag.pattern(), count=1000):
            parsed = tag.parse(key)
            if parsed is None:
                continue
            if parsed.kind is Kind.STATE:
                for k, v in client.hgetall(key).items():
                    counts[codec.decode(k)] = codec.decode(v)[0]
            elif parsed.kind is Kind.EXPIRY:
                for k, at in client.zrange(key, 0, -1, withscores=True):
                    expiries[codec.decode(k)] = int(at)
    return counts, expiries


def test_idle_keys_start_afresh_and_gc_reclaims_their_state(kafka_broker, redis_server, tmp_path):
    name = f"ttl-{uuid.uuid4().hex[:8]}"
    env = {
        "KAFKA_BOOTSTRAP_SERVERS": kafka_broker.bootstrap,
        "TTL_PIPELINE": name,
        "TTL_IN": f"{name}-in",
        "TTL_OUT": f"{name}-out",
        "TTL_SECONDS": str(TTL_S),
    }
    args = [
        "--available-now",
        "--redis-url",
        redis_server.url,
        "--checkpoint",
        str(tmp_path / "checkpoint"),
        "--output-dir",
        str(tmp_path / "out"),
        "--master",
        "local[2]",
    ]
    settings = KafkaSettings(kafka_broker.bootstrap)

    send = partial(_send, settings, env["TTL_IN"])

    client = redis_server.client()
    ks = Keyspace(name)
    send([f"u{i}" for i in range(10)], 3)
    run_pipeline(PIPELINE, args, env=env, timeout=300).check()
    counts, expiries = _state(client, ks)
    assert counts == {f"u{i}": 3 for i in range(10)}
    assert set(expiries) == set(counts)

    time.sleep(TTL_S + 1)
    send([f"u{i}" for i in range(5)], 2)
    run_pipeline(PIPELINE, args, env=env, timeout=300).check()

    # the counts topic: the second run's counts start afresh (2, not 5)
    last = defaultdict(list)
    for rec in read_topic(settings, env["TTL_OUT"]):
        last[rec.key.decode()].append(json.loads(rec.value))
    assert {u: v[-1] for u, v in last.items()} == {
        **{f"u{i}": 2 for i in range(5)},
        **{f"u{i}": 3 for i in range(5, 10)},
    }
    # expired state stays in Redis until GC (every batch reads it as gone)
    counts, _ = _state(client, ks)
    assert len(counts) == 10

    before = status(client, name).state
    assert sum(row.get("ttl_keys", 0) for row in before.values()) == 10, before

    dry = collect(client, name, dry_run=True)
    assert dry.removed["expired_state"].fields == 5
    assert len(_state(client, ks)[0]) == 10, "a dry run deletes nothing"
    result = collect(client, name)
    assert result.removed["expired_state"].fields == 5
    counts, expiries = _state(client, ks)
    assert counts == {f"u{i}": 2 for i in range(5)}
    assert set(expiries) == set(counts)
    after = status(client, name).state
    assert sum(row.get("keys", 0) for row in after.values()) == 5, after


def test_a_key_updated_after_gc_read_its_expiry_is_kept(redis_server):
    client = redis_server.client()
    ks = Keyspace(f"ttl-race-{uuid.uuid4().hex[:6]}")
    hkey, zkey = ks.state("count", 0), ks.timers("expiry", "count", 0)
    client.hset(hkey, mapping={b"a": b"1", b"b": b"1"})
    client.zadd(zkey, {b"a": 1_000, b"b": 1_000})
    # GC saw both expire at 1000 (before its threshold 2000); then a commit updated "a"
    client.zadd(zkey, {b"a": 5_000})
    gone = scripts_for(client).expire_state(keys=[hkey, zkey], args=[2_000, b"a", b"b"])
    assert gone == 1
    assert client.hkeys(hkey) == [b"a"]
    assert client.zrange(zkey, 0, -1) == [b"a"]


@pytest.mark.parametrize(
    "crash",
    [
        pytest.param(None, marks=pytest.mark.long),
        # CI time: a kill after the end-of-task commit is where a delete could go out twice
        pytest.param("before_finish", marks=pytest.mark.long),
        "after_finish",
    ],
)
def test_an_expiry_that_is_a_delete_reaches_the_sink_once(
    kafka_broker, redis_server, tmp_path, crash
):
    """``on_expiry="delete"``: a user idle past the time-to-live gets one tombstone (its
    count's delete), even when the run is killed -9 where the end of a task stores it (before
    or after) and run again; the pipeline deletes the state itself, no GC needed."""
    name = f"ttld-{uuid.uuid4().hex[:8]}"
    env = {
        "KAFKA_BOOTSTRAP_SERVERS": kafka_broker.bootstrap,
        "TTL_PIPELINE": name,
        "TTL_IN": f"{name}-in",
        "TTL_OUT": f"{name}-out",
        "TTL_SECONDS": str(TTL_S),
        "TTL_ON_EXPIRY": "delete",
    }
    args = ["--available-now", "--redis-url", redis_server.url, "--master", "local[2]"]
    args += ["--checkpoint", str(tmp_path / "checkpoint"), "--output-dir", str(tmp_path / "out")]
    settings = KafkaSettings(kafka_broker.bootstrap)

    send = partial(_send, settings, env["TTL_IN"])

    send([f"u{i}" for i in range(10)], 3)
    run_pipeline(PIPELINE, args, env=env, timeout=300).check()
    time.sleep(TTL_S + 1)
    send([f"u{i}" for i in range(5)], 2)
    if crash is not None:
        killed = run_pipeline(
            PIPELINE, args, env=env, timeout=300, crash=Crash(crash, stage="count")
        )
        assert killed.crashed, killed.output[-3000:]
    run_pipeline(PIPELINE, args, env=env, timeout=300).check()

    records = read_topic(settings, env["TTL_OUT"])
    written = Counter(dict(r.headers)[ids.ID_HEADER] for r in records)
    assert max(written.values()) == 1, "a record written twice"
    tombstones = Counter(r.key.decode() for r in records if r.value is None)
    assert tombstones == {f"u{i}": 1 for i in range(5, 10)}, tombstones
    last = {r.key.decode(): r.value for r in records}
    assert {u: json.loads(v) for u, v in last.items() if v is not None} == {
        f"u{i}": 2 for i in range(5)
    }
    counts, expiries = _state(redis_server.client(), Keyspace(name))
    assert set(counts) == {f"u{i}" for i in range(5)}, "expired state deleted by the pipeline"
