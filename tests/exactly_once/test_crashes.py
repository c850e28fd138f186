"""Exactly-once under failure: crash, resume, compare against an independent count.

Each test produces events (some duplicated upstream: same event_id, new offsets, sometimes
another partition) and runs ``tests/e2e_pipelines/orders.py`` in a child process with real
Spark, Redis and broker. The pipeline's map is non-deterministic (random noise), it copies
every event to a topic and keeps a count per user in Redis. After a crash at a chosen point
and a resume, every input must be reflected exactly once: in the keyed state, in the counts
topic, and in the copy topic (one ID per event, every copy of an ID identical).
"""

from __future__ import annotations

import json
import os
import random
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass

import pytest

from connectors.kafka_io import produce, read_topic
from onceflow import codec
from onceflow.keyspace import Keyspace
from onceflow.settings import KafkaSettings
from pipeline.testing import Crash, compare_counts, crash_and_resume, run_pipeline

pytestmark = [pytest.mark.crash, pytest.mark.kafka, pytest.mark.redis]

PIPELINE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "e2e_pipelines", "orders.py")
EVENTS = 3000
BASE_TS = 1_790_000_000_000


@dataclass
class Scenario:
    name: str
    bootstrap: str
    redis_url: str
    workdir: str
    expected: Counter
    unique_ids: set

    @property
    def topics(self):
        return {k: f"{self.name}-{k}" for k in ("in", "copy", "counts")}

    @property
    def env(self):
        t = self.topics
        return {
            "KAFKA_BOOTSTRAP_SERVERS": self.bootstrap,
            "ORDERS_PIPELINE": self.name,
            "ORDERS_IN": t["in"],
            "ORDERS_COPY": t["copy"],
            "ORDERS_COUNTS": t["counts"],
        }

    @property
    def args(self):
        return [
            "--available-now",
            "--max-records-per-batch",
            "1000",
            "--redis-url",
            self.redis_url,
            "--checkpoint",
            os.path.join(self.workdir, "checkpoint"),
            "--output-dir",
            os.path.join(self.workdir, "out"),
            "--master",
            "local[2,4]",
        ]


def make_scenario(broker, redis_url, tmp_path, seed=7):
    rng = random.Random(seed)
    name = f"orders-{uuid.uuid4().hex[:8]}"
    scn = Scenario(name, broker.bootstrap, redis_url, str(tmp_path), Counter(), set())
    events = [
        {"event_id": str(uuid.uuid4()), "user": f"u{rng.randrange(17)}", "ts": BASE_TS + 50 * i}
        for i in range(EVENTS)
    ]
    scn.expected = Counter(e["user"] for e in events)
    scn.unique_ids = {e["event_id"] for e in events}
    # An at-least-once producer re-sends ~6%: new offsets, sometimes another partition,
    # sometimes right after the original (same batch), sometimes much later.
    sends = [(e, i % 2) for i, e in enumerate(events)]
    for e in rng.sample(events, EVENTS * 6 // 100):
        sends.insert(rng.randrange(len(sends) + 1), (e, rng.randrange(2)))
    produce(
        KafkaSettings(broker.bootstrap),
        scn.topics["in"],
        [(None, json.dumps(e).encode(), None) for e, _ in sends],
        partitions=2,
        partitioner=lambda n, _key: sends[n][1],
    )
    return scn


def verify(scn, redis_client, *, copy_duplicates_allowed=False):
    settings = KafkaSettings(scn.bootstrap)
    # 1. keyed state in Redis: one count per unique event, per user
    state = {}
    ks = Keyspace(scn.name)
    for partition in range(2):
        for k, v in redis_client.hgetall(ks.state("count", partition)).items():
            state[codec.decode(k)] = codec.decode(v)
    report = compare_counts(scn.expected, state)
    assert report.ok, f"keyed state: {report}"
    # 2. the counts topic: the newest count of each user
    latest = {}
    for rec in read_topic(settings, scn.topics["counts"]):
        user = rec.key.decode()
        latest[user] = max(latest.get(user, 0), json.loads(rec.value))
    report = compare_counts(scn.expected, latest)
    assert report.ok, f"counts topic: {report}"
    # 3. the copy topic: exactly one ID per event; every copy of an ID carries the same value
    by_id = defaultdict(set)
    raw = 0
    for rec in read_topic(settings, scn.topics["copy"]):
        by_id[rec.headers["onceflow-id"]].add(rec.value)
        raw += 1
    assert all(len(values) == 1 for values in by_id.values()), "an ID was written with two values"
    per_event = Counter(json.loads(next(iter(v)))["event_id"] for v in by_id.values())
    report = compare_counts(Counter(scn.unique_ids), per_event)
    assert report.ok, f"copy topic: {report}"
    duplicates = raw - len(by_id)
    if not copy_duplicates_allowed:
        assert duplicates == 0, f"{duplicates} records written twice to the copy topic"
    return duplicates


def test_clean_run_is_exact_and_drops_upstream_duplicates(broker, redis_server, tmp_path):
    scn = make_scenario(broker, redis_server.url, tmp_path)
    outcome = run_pipeline(PIPELINE, scn.args, env=scn.env).check()
    assert "duplicates dropped" in outcome.output
    verify(scn, redis_server.client())
    stats = redis_server.client().hgetall(Keyspace(scn.name).stats("events"))
    assert int(stats[b"duplicates"]) == EVENTS * 6 // 100


TASK_FAILURES = [
    Crash("before_commit", stage="events", batch=1, partition=0, mode="raise"),
    Crash("after_commit", stage="events", batch=1, partition=1, mode="raise"),
    Crash("after_sink_write", stage="events", batch=2, partition=0, mode="raise"),
    Crash("after_commit", stage="count", batch=1, partition=0, mode="raise"),
]


@pytest.mark.parametrize("crash", TASK_FAILURES, ids=lambda c: c.env())
def test_task_failure_is_retried_without_loss_or_duplicate(crash, broker, redis_server, tmp_path):
    scn = make_scenario(broker, redis_server.url, tmp_path)
    outcome = run_pipeline(PIPELINE, scn.args, env=scn.env, crash=crash).check()
    assert outcome.where, "the failure was never injected"
    duplicates = verify(
        scn, redis_server.client(), copy_duplicates_allowed=crash.point == "after_sink_write"
    )
    assert duplicates <= 1000


KILLS = [
    Crash("after_commit", stage="events", batch=1, partition=0),  # driver killed mid-batch
    Crash("after_commit", stage="count", batch=2),  # mid-batch, after the exchange
    Crash("batch_end", batch=1),  # after every sink write, before Spark's commit
    Crash("after_sink_write", stage="count", batch=1),  # produced, not yet marked delivered
]


@pytest.mark.parametrize("crash", KILLS, ids=lambda c: c.env())
def test_kill_9_then_resume_is_exact(crash, broker, redis_server, tmp_path):
    scn = make_scenario(broker, redis_server.url, tmp_path)
    first, second = crash_and_resume(PIPELINE, crash, scn.args, env=scn.env)
    assert first.crashed and second.returncode == 0
    verify(scn, redis_server.client(), copy_duplicates_allowed=crash.point == "after_sink_write")


def test_redis_killed_and_restarted_from_its_aof(broker, redis_factory, tmp_path):
    redis = redis_factory()
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
    import subprocess
    import sys

    env = {**os.environ, **scn.env}
    proc = subprocess.Popen(
        [sys.executable, "-m", "onceflow", "run", PIPELINE, *scn.args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "batch 0:" in line:
            redis.restart(kill=True)
            break
    lines.extend(proc.stdout)
    assert proc.wait(300) == 0, "".join(lines[-50:])
    import redis as redis_py

    verify(scn, redis_py.Redis.from_url(redis.url))


def test_a_zombie_driver_is_fenced(broker, redis_server, tmp_path):
    """A second driver starting makes the first one's commits fail instead of double-apply."""
    from dedup.config import DedupConfig
    from dedup.errors import FencedError
    from dedup.guard import ExactlyOnceGuards
    from graph_optimizer.compile.spec import stage_spec
    from onceflow.settings import RedisSettings
    from pipeline.loader import load_pipeline

    scn = make_scenario(broker, redis_server.url, tmp_path)
    os.environ.update(scn.env)
    plan = load_pipeline(PIPELINE).plan()
    stage = plan.ordered[-1]
    spec = stage_spec(plan, stage, dead_letters=None)
    client = redis_server.client()
    ks = Keyspace(scn.name)
    old_epoch = client.incr(ks.epoch)
    guards = ExactlyOnceGuards(RedisSettings(redis_server.url), scn.name, old_epoch, DedupConfig())
    zombie = guards(spec, 0, 0, 0)
    zombie.open()
    client.incr(ks.epoch)  # a new driver starts
    row = (0, b"z" * 16, int(time.time() * 1000), codec.encode("u1"), ("u1", 1))
    with pytest.raises(FencedError, match="newer driver"):
        zombie.commit(0, [row], [], {"count": {codec.encode("u1"): codec.encode(1)}})
    assert client.hgetall(ks.state("count", 0)) == {}
