"""Scenarios shared by the exactly-once tests: produce events, verify outputs.

Events are produced with some duplicated upstream (same event_id, new offsets, sometimes
another partition); ``verify`` compares keyed state, the counts topic and the copy topic of
``tests/e2e_pipelines/orders.py`` against an independent count of the input.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from onceflow.connectors.kafka.topics import produce, read_topic
from onceflow.kernel import codec
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.settings import KafkaSettings
from onceflow.testing.harness import compare_counts

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
    extra_env: dict = field(default_factory=dict)

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
            **self.extra_env,
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
    produce_sends(scn, sends)
    return scn


def produce_sends(scn, sends):
    """Produce ``(event, partition)`` pairs, in order, to the scenario's input topic."""
    produce(
        KafkaSettings(scn.bootstrap),
        scn.topics["in"],
        [(None, json.dumps(e).encode(), None) for e, _ in sends],
        partitions=2,
        partitioner=lambda n, _key: sends[n][1],
    )


def run_with_fault(scn, fault, after="batch 0:"):
    """Run the pipeline; when ``after`` appears in its output, call ``fault()``.

    Returns the output lines, the last one ``exit status N``.
    """
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
    injected = False
    for line in proc.stdout:
        lines.append(line)
        if not injected and after in line:
            fault()
            injected = True
    code = proc.wait(600)
    assert injected, "the fault was never injected:\n" + "".join(lines[-40:])
    lines.append(f"exit status {code}\n")
    return lines


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
