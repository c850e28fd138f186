"""Scenarios shared by the exactly-once tests: produce events, verify outputs.

Events are produced with some duplicated upstream (same event_id, new offsets, sometimes
another partition); ``verify`` compares keyed state, the counts topic and the copy topic of
``tests/e2e_pipelines/orders.py`` against an independent count of the input.

The counts topic is checked emission by emission: Spark's checkpoint says which offsets each
micro-batch read, so the test knows, without asking Onceflow, in which batch each event first
arrived, hence which users' counts each batch must emit and with which values. A lost or
doubled emission, or one with a wrong value, fails the check; a repeated one (same ID, same
value) is a sink copy, allowed only where the design admits it (a crash after a sink write,
in the stage that writes that sink) and then counted.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import produce, read_topic
from onceflow.kernel import codec
from onceflow.kernel.scopes import node_state
from onceflow.testing.harness import compare_counts, kill_session

PIPELINE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "e2e_pipelines", "orders.py")
EVENTS = 3000
# Event times of a few hours ago: inside the dedup horizon, not ahead of the clock, and not
# old enough for a broker's default time retention (7 days) to delete the outputs.
BASE_TS = (int(time.time()) // 3600 - 3) * 3_600_000


@dataclass
class Scenario:
    name: str
    bootstrap: str
    redis_url: str
    workdir: str
    expected: Counter
    unique_ids: set
    extra_env: dict = field(default_factory=dict)
    sent: dict = field(default_factory=dict)  # partition -> events in offset order

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


def make_scenario(broker, redis_url, tmp_path, seed=7, resent_percent=6):
    """Events of 17 users over two partitions; ``resent_percent`` of them are sent twice."""
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
    for e in rng.sample(events, EVENTS * resent_percent // 100):
        sends.insert(rng.randrange(len(sends) + 1), (e, rng.randrange(2)))
    produce_sends(scn, sends)
    return scn


def produce_sends(scn, sends):
    """Produce ``(event, partition)`` pairs, in order, to the scenario's input topic."""
    for e, partition in sends:
        scn.sent.setdefault(partition, []).append(e)
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


def onceflow_cli(*args, kill_after_s=None, kill_after_line=None):
    """``python -m onceflow ARGS``, killed -9 (its whole session) after ``kill_after_s``
    seconds or after a line holding ``kill_after_line``. Returns (exit status, output)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "onceflow", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    if kill_after_s is not None:
        time.sleep(kill_after_s)
        kill_session(proc.pid)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if kill_after_line and kill_after_line in line:
            kill_session(proc.pid)
            break
    code = proc.wait(120)
    return code, "".join(lines)


def cli_killed_then_done(args, rng):
    """``onceflow ARGS`` killed -9 once at a random moment, then run to its end.

    The kill may land after it finished: then the second run finds its work done (a savepoint
    folder that exists, a namespace restored). Returns the second run's output.
    """
    onceflow_cli(*args, kill_after_s=rng.uniform(0.3, 2.0))
    code, out = onceflow_cli(*args)
    assert code == 0 or "exists" in out or "holds a pipeline" in out, out
    return out


def run_args(scn, redis_url, workdir, parallelism, *extra):
    """The scenario's run arguments on another Redis and work folder (checkpoint, outputs)."""
    args = list(scn.args)
    args[args.index("--redis-url") + 1] = redis_url
    args[args.index("--checkpoint") + 1] = os.path.join(workdir, "checkpoint")
    args[args.index("--output-dir") + 1] = os.path.join(workdir, "out")
    return [*args, "--parallelism", str(parallelism), *extra]


def batches_read(scn):
    """For every committed micro-batch, the events it read (Spark's offset log)."""
    topic = scn.topics["in"]
    folder = os.path.join(scn.workdir, "checkpoint")
    commits = sorted(int(f) for f in os.listdir(os.path.join(folder, "commits")) if f.isdigit())
    start = {p: 0 for p in scn.sent}
    out = {}
    for batch in commits:
        with open(os.path.join(folder, "offsets", str(batch)), encoding="utf-8") as fh:
            ends = json.loads(fh.read().splitlines()[2])
        events = []
        for partition, sent in scn.sent.items():
            end = ends.get(f"{topic}:{partition}", start[partition])
            events += sent[start[partition] : end]
            start[partition] = end
        out[batch] = events
    return out


def expected_emissions(scn):
    """Per user, the counts each batch must emit: the cumulative count after the batch."""
    seen = set()
    running = Counter()
    emissions = defaultdict(set)
    for _batch, events in sorted(batches_read(scn).items()):
        touched = set()
        for e in events:
            if e["event_id"] in seen:
                continue
            seen.add(e["event_id"])
            running[e["user"]] += 1
            touched.add(e["user"])
        for user in touched:
            emissions[user].add(running[user])
    return emissions


def verify(scn, redis_client, *, copies_in=(), connect=None, namespace=None):
    """Check keyed state, every emission of the counts topic and the copy topic.

    ``copies_in`` names the topics ("copy", "counts") where sink copies are legitimate (a
    crash after that sink's write); their number is returned per topic. ``namespace``: where
    the keyed state is (default the pipeline's name; another after a savepoint's restore).
    """
    settings = KafkaSettings(scn.bootstrap)
    # 1. keyed state in Redis: one count per unique event, per user
    stored = node_state(redis_client, namespace or scn.name, "count", connect)
    state = {codec.decode(k): codec.decode(v) for k, v in stored.items()}
    report = compare_counts(scn.expected, state)
    assert report.ok, f"keyed state: {report}"
    copies = {}
    # 2. the counts topic: exactly the emissions the batches must make, one value per ID
    by_id = defaultdict(set)
    users = {}
    raw = 0
    for rec in read_topic(settings, scn.topics["counts"]):
        by_id[rec.headers["onceflow-id"]].add(json.loads(rec.value))
        users[rec.headers["onceflow-id"]] = rec.key.decode()
        raw += 1
    assert all(len(v) == 1 for v in by_id.values()), "a count ID was written with two values"
    emitted = defaultdict(set)
    for rid, values in by_id.items():
        emitted[users[rid]].add(next(iter(values)))
    want = expected_emissions(scn)
    assert dict(emitted) == dict(want), _diff("counts topic emissions", want, emitted)
    assert sum(len(v) for v in want.values()) == len(by_id), "one emission ID per batch and user"
    copies["counts"] = raw - len(by_id)
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
    copies["copy"] = raw - len(by_id)
    for topic, n in copies.items():
        if topic not in copies_in:
            assert n == 0, f"{n} records written twice to the {topic} topic"
    return copies


def _diff(what, want, got):
    lines = [what + ":"]
    for user in sorted(set(want) | set(got)):
        if want.get(user) != got.get(user):
            missing = sorted(want.get(user, set()) - got.get(user, set()))
            extra = sorted(got.get(user, set()) - want.get(user, set()))
            lines.append(f"  {user}: missing {missing[:8]}, unexpected {extra[:8]}")
    return "\n".join(lines[:20])
