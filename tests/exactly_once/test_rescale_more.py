"""Rescale with state in the places ``test_rescale.py`` does not go, and a topic that grew.

Each test runs ``tests/e2e_pipelines/orders.py`` (a non-deterministic map, a copy topic, a
count per user in keyed state, a counts topic) and ends with ``verify``: the keyed state, every
emission of the counts topic (batch by batch, from Spark's offset log) and the copy topic
against an independent count of the input.

* On a Redis Cluster, ``onceflow rescale --redis-url redis+cluster://...`` moves the count's
  partition scopes from 4 to 7 (each scope in a slot of its own, over several masters); the
  run then goes on at 7 without ``--rescale``.
* After ``onceflow gc`` forgot generations under a short horizon, a rescale from 4 to 3 carries
  each scope's GC floor and exactly the seen-IDs GC left; copies of counted events sent after
  it are dropped (inside the horizon) or dead-lettered as late (outside it), never counted.
* The input topic grows from 2 to 4 partitions while the pipeline is stopped and copies of
  counted events arrive on the new partitions only: the source stage's one seen-ID set for
  every input partition drops them.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid
from collections import Counter

import pytest
from kafka.admin import KafkaAdminClient, NewPartitions

from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.sink import ERROR_HEADER
from onceflow.connectors.kafka.topics import read_topic
from onceflow.kernel.key_hash import exchange_partition
from onceflow.kernel.keyspace import GC_FLOOR_FIELD, Keyspace
from onceflow.kernel.scopes import Scopes, node_keyspaces, read_scopes
from onceflow.kernel.seen_layout import seen_id
from onceflow.kernel.slots import namespace_slot
from onceflow.runtime.driver.rescale_staging import READY, STAGED, Layout, scope_shards
from onceflow.testing.harness import run_pipeline
from tests.exactly_once.scenario import (
    BASE_TS,
    EVENTS,
    PIPELINE,
    Scenario,
    batches_read,
    make_scenario,
    produce_sends,
    verify,
)
from tests.exactly_once.test_redis_cluster import cluster_url, tag_clients

# CI time: longer variants of test_rescale.py's default round (a rescale up and down under
# kill -9, with a savepoint restored on another Redis); they run with --long.
pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.long]


def _args(scn, parallelism, *extra):
    return [*scn.args, "--parallelism", str(parallelism), *extra]


def _onceflow(*args):
    return subprocess.run(
        [sys.executable, "-m", "onceflow", *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def _rescale_cli(scn, parallelism):
    done = _onceflow(
        "rescale", "--namespace", scn.name, "--parallelism", str(parallelism),
        "--redis-url", scn.redis_url,
    )  # fmt: skip
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    assert f"rescaled {scn.name!r} to {parallelism} partitions" in said, said
    return said


def _counted(scn):
    """The events the committed micro-batches read, first copies only, in reading order."""
    seen, out = set(), []
    for _batch, events in sorted(batches_read(scn).items()):
        for e in events:
            if e["event_id"] not in seen:
                seen.add(e["event_id"])
                out.append(e)
    return out


def _event(rng, ts):
    """An event of one of the scenario's 17 users."""
    return {"event_id": str(uuid.uuid4()), "user": f"u{rng.randrange(17)}", "ts": ts}


def _one_redis(client):
    return lambda _tag: client


def _check_placement(connect, scn, parallelism):
    """Every key's state is in the partition the exchange sends it to (at ``parallelism``)."""
    home = connect(scn.name)
    assert read_scopes(home, Keyspace(scn.name)).parallelism == parallelism
    keyspaces = node_keyspaces(home, scn.name, "count")
    assert len(keyspaces) == parallelism
    held = 0
    for p, ks in enumerate(keyspaces):
        for field in connect(ks.tag).hkeys(ks.state("count", p)):
            assert exchange_partition(field, parallelism) == p, (field, p)
            held += 1
    assert held == 17, f"{held} keys held: one per user expected"


def _check_no_leftovers(connect, keys, scn, parallelism):
    """No scope of another parallelism, no staged key and no ready mark is left."""
    stored = read_scopes(connect(scn.name), Keyspace(scn.name))
    wanted = {ks.tag for ks in Scopes(scn.name, stored.stages, parallelism).partition_keyspaces()}
    tags = set()
    for key in keys:
        assert f"}}:{STAGED}:" not in key and not key.endswith(f":{READY}"), key
        tag = key.split("}")[0][len("of:{") :]
        if tag != scn.name:
            tags.add(tag)
    assert tags == wanted, f"scopes left or missing: {sorted(tags ^ wanted)}"


def _seen_ids(connect, scn):
    """Per partition of the count stage: the (receiver, generation, ID) of its seen-IDs."""
    home = Keyspace(scn.name)
    client = connect(scn.name)
    scopes = read_scopes(client, home)
    shards = scope_shards(Layout(int(client.hget(home.meta, "shards")), 0), scopes.parallelism)
    out = []
    for p in range(scopes.parallelism):
        ks = scopes.keyspace("count", p)
        tagged = connect(ks.tag)
        ids = set()
        for key in tagged.scan_iter(ks.seen_pattern(), count=1000):
            q = ks.parse(key)
            ids |= {(q.name, q.generation, seen_id(f, q.shard, shards)) for f in tagged.hkeys(key)}
        out.append(ids)
    return out


def _gc_floors(connect, scn):
    """Per partition scope of the count stage: the GC floor its hash holds (None: none)."""
    scopes = read_scopes(connect(scn.name), Keyspace(scn.name))
    floors = []
    for ks in scopes.partition_keyspaces():
        raw = connect(ks.tag).hget(ks.gc, GC_FLOOR_FIELD)
        floors.append(None if raw is None else int(raw))
    return floors


def _dead_letters(scn):
    """``event_id -> error`` of the pipeline's dead-letter topic (none if it was never made)."""
    try:
        records = read_topic(KafkaSettings(scn.bootstrap), f"{scn.name}.dead-letters")
    except ConnectorError as exc:
        if "does not exist" not in str(exc):
            raise
        return {}
    out = {}
    for rec in records:
        event = json.loads(json.loads(rec.value)["value"])
        out[event["event_id"]] = rec.headers.get(ERROR_HEADER, b"").decode()
    return out


# -- 1. a Redis Cluster ----------------------------------------------------------------------


@pytest.mark.cluster
def test_rescale_on_a_redis_cluster_keeps_every_count(broker, redis_cluster, tmp_path):
    url = cluster_url(redis_cluster)
    scn = make_scenario(broker, url, tmp_path)
    connect = tag_clients(url)
    rng = random.Random(23)
    run_pipeline(PIPELINE, _args(scn, 4, "--stop-after-batches", "2"), env=scn.env).check()
    counted = _counted(scn)
    produce_sends(scn, [(e, rng.randrange(2)) for e in rng.sample(counted, 150)])
    before = set().union(*_seen_ids(connect, scn))
    assert before, "the count stage marked IDs seen"
    said = _rescale_cli(scn, 7)
    assert "from 4 to 7 partitions" in said, said
    _check_placement(connect, scn, 7)
    assert all(before <= ids for ids in _seen_ids(connect, scn)), "a partition lost seen-IDs"
    keys = []
    for master in redis_cluster.masters():
        keys += redis_cluster.node_client(master.port).scan_iter(f"of:{{{scn.name}*", count=1000)
    _check_no_leftovers(connect, keys, scn, 7)
    scopes = read_scopes(connect(scn.name), Keyspace(scn.name)).partition_keyspaces()
    owners = {redis_cluster.slot_owner(namespace_slot(ks.tag)).port for ks in scopes}
    assert len(owners) > 1, "the 7 scopes all hash to one master: the move crossed none"
    produce_sends(scn, [(e, rng.randrange(2)) for e in rng.sample(_counted(scn), 150)])
    run_pipeline(PIPELINE, _args(scn, 7), env=scn.env).check()  # already 7: no --rescale
    _check_placement(connect, scn, 7)
    verify(scn, connect(scn.name), connect=connect)


# -- 2. GC, then a rescale -------------------------------------------------------------------

# 3000 events over 10 minutes of event time, a 10-second horizon in half-second generations. A
# batch's seen-IDs go to the generation of its dedup time, which moves with the wall clock too:
# each micro-batch (a second or so apart) has its own, and GC forgets the first batch's once
# the watermark of the last acknowledged batch is a horizon past its newest event.
STEP_MS = 200
FIRST = 2400  # events produced before the first run (three micro-batches of at most 1000)


def _short_horizon_scenario(broker, redis_url, tmp_path, rng):
    """Events with copies a few records after their original; returns the scenario (the first
    ``FIRST`` events produced) and the sends of the others, to produce later."""
    name = f"orders-gc-{uuid.uuid4().hex[:8]}"
    horizon = {"ORDERS_HORIZON": "10s", "ORDERS_BUCKET": "500ms", "ORDERS_OUT_OF_ORDER": "5s"}
    scn = Scenario(name, broker.bootstrap, redis_url, str(tmp_path), Counter(), set(), horizon)
    events = [_event(rng, BASE_TS + STEP_MS * i) for i in range(EVENTS)]
    scn.expected = Counter(e["user"] for e in events)
    scn.unique_ids = {e["event_id"] for e in events}

    def with_copies(part):
        sends = [(e, i % 2) for i, e in enumerate(part)]
        for e in rng.sample(part, len(part) // 20):
            at = part.index(e) + rng.randrange(1, 10)
            sends.insert(at, (e, rng.randrange(2)))
        return sends

    produce_sends(scn, with_copies(events[:FIRST]))
    return scn, with_copies(events[FIRST:])


def _gc_cli(scn):
    done = _onceflow("gc", "--namespace", scn.name, "--redis-url", scn.redis_url)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_gc_between_rescales_keeps_dedup(broker, redis_server, tmp_path):
    client = redis_server.client()
    connect = _one_redis(client)
    rng = random.Random(31)
    scn, rest = _short_horizon_scenario(broker, redis_server.url, tmp_path, rng)
    run_pipeline(PIPELINE, _args(scn, 4), env=scn.env).check()  # all produced so far
    before_gc = set().union(*_seen_ids(connect, scn))
    gc = _gc_cli(scn)
    assert gc["forgotten_generations"], f"GC forgot nothing: {gc}"
    floors = _gc_floors(connect, scn)
    assert None not in floors, f"GC wrote no floor in some partition scope: {floors}"
    seen = _seen_ids(connect, scn)
    union = set().union(*seen)
    assert union and union < before_gc, "GC must delete some, not all, of the count's seen-IDs"
    said = _rescale_cli(scn, 3)
    assert "from 4 to 3 partitions" in said, said
    _check_placement(connect, scn, 3)
    keys = [k.decode() for k in client.scan_iter(f"of:{{{scn.name}*", count=1000)]
    _check_no_leftovers(connect, keys, scn, 3)
    assert _gc_floors(connect, scn) == [max(floors)] * 3, "a GC floor was not carried"
    assert all(ids == union for ids in _seen_ids(connect, scn)), (
        "each new partition must hold exactly the seen-IDs GC left in the old ones"
    )
    # copies of counted events: the oldest are past the horizon (their seen-IDs are gone, they
    # must go to the dead letters as late), the newest inside it (dropped as duplicates)
    counted = sorted(_counted(scn), key=lambda e: e["ts"])
    old, recent = counted[:60], counted[-20:]
    copies = [(e, rng.randrange(2)) for e in old + recent]
    rng.shuffle(copies)
    produce_sends(scn, copies + rest)
    run_pipeline(PIPELINE, _args(scn, 3), env=scn.env).check()
    verify(scn, client)
    dead = _dead_letters(scn)
    assert {e["event_id"] for e in old} <= set(dead), "a copy past the horizon went unreported"
    assert all("dedup horizon" in error for error in dead.values()), dead
    assert not {e["event_id"] for e in recent} & set(dead), "a copy inside the horizon was late"
    assert set(dead) <= {e["event_id"] for e in old}
    assert _gc_cli(scn)["forgotten_generations"], "GC on the rescaled scopes forgot nothing"
    verify(scn, client)  # GC took nothing that matters


# -- 3. a topic that grew partitions ---------------------------------------------------------


def test_a_topic_that_grew_partitions_keeps_its_dedup_history(kafka_broker, redis_server, tmp_path):
    scn = make_scenario(kafka_broker, redis_server.url, tmp_path)
    client = redis_server.client()
    rng = random.Random(5)
    run_pipeline(PIPELINE, [*scn.args, "--stop-after-batches", "2"], env=scn.env).check()
    admin = KafkaAdminClient(bootstrap_servers=scn.bootstrap)
    try:
        admin.create_partitions({scn.topics["in"]: NewPartitions(total_count=4)})
    finally:
        admin.close()
    # copies of counted events on the new partitions only (20 of them on both), new events too
    copies = rng.sample(_counted(scn), 200)
    sends = [(e, rng.choice((2, 3))) for e in copies[20:]]
    sends += [(e, 2) for e in copies[:20]] + [(e, 3) for e in copies[:20]]
    fresh = [_event(rng, BASE_TS + 50 * i) for i in range(EVENTS, EVENTS + 200)]  # after all
    scn.expected.update(e["user"] for e in fresh)
    scn.unique_ids |= {e["event_id"] for e in fresh}
    sends += [(e, 2 + i % 2) for i, e in enumerate(fresh)]
    rng.shuffle(sends)
    produce_sends(scn, sends)
    run_pipeline(PIPELINE, scn.args, env=scn.env).check()
    ends = _last_offsets(scn)
    for p, sent in scn.sent.items():
        assert ends.get(f"{scn.topics['in']}:{p}") == len(sent), f"partition {p}: {ends}"
    verify(scn, client)
    assert not _dead_letters(scn), "a copy on a new partition was not found seen"


def _last_offsets(scn):
    """Where the last committed micro-batch ended, per ``topic:partition`` (Spark's log)."""
    folder = os.path.join(scn.workdir, "checkpoint")
    last = max(int(f) for f in os.listdir(os.path.join(folder, "commits")) if f.isdigit())
    with open(os.path.join(folder, "offsets", str(last)), encoding="utf-8") as fh:
        return json.loads(fh.read().splitlines()[2])
