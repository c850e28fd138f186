"""Exactly-once on a Redis Cluster, through a failover of the master holding the pipeline.

A real cluster of 3 masters and 3 replicas (Debian's ``redis-server`` in cluster mode, AOF
on, ``appendfsync everysec``) on loopback, reached with ``redis+cluster://``. The pipeline
(``tests/e2e_pipelines/orders.py``: a non-deterministic map, a copy of every event to Kafka, a
count per user) runs against it. Its source stage lives in the namespace's slot, each
partition of the keyed count in a slot of its own (a partition scope), so its state spreads
over the masters. A task is held at a chosen point (a commit done, or a Kafka transaction
committed) while the master of that task's slot is SIGKILLed and a replica takes over; the
run says so (writes the old master had not passed on may be gone, so the batch is not
committed) and runs the batch again on the promoted replica, from what it holds, to the end of
the input. The independent count must then match the keyed state, the counts topic and the
copy topic: nothing lost, nothing doubled.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from typing import Any

import pytest
import redis as redis_py

from onceflow.backup.store import replay
from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import read_topic
from onceflow.kernel import codec
from onceflow.kernel.errors import ConfigError
from onceflow.kernel.keyspace import Keyspace, Kind
from onceflow.kernel.scopes import node_state, read_scopes, scope_name
from onceflow.kernel.settings import RedisSettings, redis_client
from onceflow.kernel.slots import namespace_slot
from onceflow.testing import LocalRedisCluster
from onceflow.testing.harness import Crash, compare_counts, crash_and_resume, run_pipeline
from tests.exactly_once.scenario import (
    BASE_TS,
    EVENTS,
    PIPELINE,
    Scenario,
    make_scenario,
    produce_sends,
    verify,
)

pytestmark = [pytest.mark.crash, pytest.mark.kafka, pytest.mark.redis, pytest.mark.cluster]


def cluster_url(cluster: LocalRedisCluster) -> str:
    """Every node as a seed: a run can start while one of them is down."""
    return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in cluster.ports)


def master_index(cluster: LocalRedisCluster, namespace: str) -> int:
    owner = cluster.slot_owner(namespace_slot(namespace))
    return [m.port for m in cluster.masters()].index(owner.port)


def test_namespaces_spread_over_masters_and_a_client_follows_its_slot(redis_cluster):
    """Each namespace's keys sit on the master of its slot; a failover is ridden out."""
    settings = RedisSettings(cluster_url(redis_cluster))
    owners = {}
    for name in ("orders-a", "orders-b", "orders-c", "orders-d", "orders-e", "orders-f"):
        client = redis_client(settings, name)
        client.set(Keyspace(name).acked, 7)
        owner = redis_cluster.slot_owner(namespace_slot(name)).port
        owners[name] = owner
        held = redis_cluster.node_client(owner).get(Keyspace(name).acked)
        assert held == "7", f"{name}'s key is not on the master of its slot"
    assert len(set(owners.values())) > 1, "six namespaces all hashed to one master"
    # a failover of one namespace's master: its client reconnects to the promoted replica
    name = "orders-a"
    client = redis_client(settings, name)
    pipe = client.pipeline(transaction=False)
    pipe.incr(Keyspace(name).epoch)
    pipe.execute_command("WAIT", 1, 5000)
    assert pipe.execute()[1] == 1, "the replica did not acknowledge"
    redis_cluster.kill_master(master_index(redis_cluster, name))
    t0 = time.monotonic()
    assert int(client.incr(Keyspace(name).epoch)) == 2, "the acknowledged write was lost"
    print(f"[redis-cluster] a command rode the failover out in {time.monotonic() - t0:.1f} s")
    failover = redis_cluster.wait_failover()
    assert redis_cluster.slot_owner(namespace_slot(name)).port == failover.promoted_port
    redis_cluster.restart_node()  # the old master comes back as a replica


def tag_clients(url: str) -> Any:
    """Clients by hash tag (the namespace's, or a partition scope's) on the cluster."""
    settings = RedisSettings(url)
    return lambda tag: redis_client(settings, tag)


def show_spread(cluster: LocalRedisCluster, url: str, namespace: str) -> set[int]:
    """Print which master serves each of the pipeline's hash tags; check its keys are there."""
    connect = tag_clients(url)
    masters = set()
    for ks in read_scopes(connect(namespace), Keyspace(namespace)).keyspaces():
        owner = cluster.slot_owner(namespace_slot(ks.tag)).port
        held = list(cluster.node_client(owner).scan_iter(match=ks.pattern(), count=1000))
        assert held, f"no key of {ks.tag} on {owner}, the master of its slot"
        print(f"[redis-cluster] {ks.tag}: {len(held)} keys on master {owner}")
        masters.add(owner)
    return masters


@pytest.mark.parametrize(
    "where",
    [
        # a task of the keyed stage, in its partition scope, paused after a commit: the
        # master of that scope's slot dies
        Crash("after_commit", stage="count", batch=2, partition=1, mode="pause"),
        pytest.param(  # a source-stage task: the namespace's own master dies
            Crash("after_commit", stage="events", batch=1, partition=0, mode="pause"),
            marks=pytest.mark.long,
        ),
        pytest.param(  # the delivery's replica wait is what keeps this one exact
            Crash("after_sink_commit", stage="count", batch=2, partition=1, mode="pause"),
            marks=pytest.mark.long,
        ),
    ],
    ids=["scope-after-a-commit", "namespace-after-a-commit", "scope-after-a-kafka-commit"],
)
def test_a_failover_mid_batch_loses_and_doubles_nothing(where, broker, redis_cluster, tmp_path):
    """The master of the paused task's hash tag dies: the run runs the batch again, ends."""
    url = cluster_url(redis_cluster)
    scn = make_scenario(broker, url, tmp_path)
    connect = tag_clients(url)
    killed = []

    def kill_the_tasks_master():
        scopes = read_scopes(connect(scn.name), Keyspace(scn.name))
        tag = scopes.keyspace(where.stage, where.partition).tag
        assert (tag != scn.name) == (where.stage == "count"), "the keyed stage is scoped"
        index = master_index(redis_cluster, tag)
        killed.append(redis_cluster.kill_master(index))
        killed.append(time.monotonic())

    again: list[float] = []

    def note_again(line: str) -> None:
        if "running it again" in line and not again:
            again.append(time.monotonic())

    args = scn.args
    first = run_pipeline(
        PIPELINE, args, env=scn.env, crash=where, fault=kill_the_tasks_master, echo=note_again
    )
    assert killed, "the pause point was never reached:\n" + first.output[-3000:]
    failover = redis_cluster.wait_failover()
    said = [line for line in first.output.splitlines() if "failed over during" in line]
    print(f"[redis-cluster] failover {failover.seconds:.1f} s after the kill: {said}")
    assert first.returncode == 0, first.output[-3000:]
    assert again, "the batch the failover cut short was not run again:\n" + first.output[-3000:]
    print(f"[redis-cluster] from the kill to the batch run again: {again[0] - killed[1]:.1f} s")
    verify(scn, connect(scn.name), connect=connect)
    second = run_pipeline(PIPELINE, args, env=scn.env).check()  # nothing left to do
    assert second.returncode == 0
    verify(scn, connect(scn.name), connect=connect)
    with pytest.raises(ConfigError, match="partition scope"):  # never a silent empty read
        node_state(connect(scn.name), scn.name, "count")
    show_spread(redis_cluster, url, scn.name)
    redis_cluster.restart_node(killed[0].port)  # back as a replica, for the next test
    operator_commands_find_the_pipeline(url, scn)


def copies_on_other_partitions(scn) -> int:
    """How many events were re-sent on the other input partition than their first copy."""
    first = {}
    for partition, events in sorted(scn.sent.items()):
        for e in events:
            first.setdefault(e["event_id"], set()).add(partition)
    return sum(1 for partitions in first.values() if len(partitions) > 1)


@pytest.mark.long
@pytest.mark.parametrize(
    "crash",
    [
        Crash("after_commit", stage="events", batch=1, partition=0),
        Crash("before_commit", stage="events", batch=2, partition=1),
    ],
    ids=lambda c: c.env(),
)
def test_kill_9_on_a_cluster_drops_copies_from_other_partitions_once(
    crash, broker, redis_cluster, tmp_path
):
    """kill -9 of every process mid-run on a Redis Cluster, then a rerun: exact.

    Copies of events re-sent upstream land on the other input partition (another task of the
    source stage), in the same micro-batch or a later one; each must be dropped exactly once
    whatever the kill interrupted. The source stage's seen-IDs are one set in the
    namespace's slot.
    """
    url = cluster_url(redis_cluster)
    scn = make_scenario(broker, url, tmp_path)
    assert copies_on_other_partitions(scn) >= 5, "the scenario must re-send across partitions"
    first, second = crash_and_resume(PIPELINE, crash, scn.args, env=scn.env)
    assert first.crashed and second.returncode == 0, second.output[-3000:]
    connect = tag_clients(url)
    verify(scn, connect(scn.name), connect=connect)
    home = Keyspace(scn.name)
    stats = connect(scn.name).hgetall(home.stats("events"))
    # copies dropped in a chunk the killed attempt committed are not in its backup: the
    # rerun finds them seen and counts them again (the counter, not the output, is over)
    assert int(stats[b"duplicates"]) >= EVENTS * 6 // 100
    assert list(connect(scn.name).scan_iter(home.seen_pattern("events"), count=1000))


def onceflow(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "onceflow", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def operator_commands_find_the_pipeline(url: str, scn) -> None:
    """``status --all`` and ``gc --all`` on a cluster: namespaces on several masters."""
    other = "elsewhere"  # hashes to another master than most names: found all the same
    redis_client(RedisSettings(url), other).hset(
        Keyspace(other).meta, mapping={"parallelism": 2, "layout": 3}
    )
    listed = onceflow("status", "--all", "--json", "--redis-url", url)
    assert listed.returncode == 0, listed.stderr
    names = {s["namespace"] for s in json.loads(listed.stdout)}
    assert {scn.name, other} <= names
    gc = onceflow("gc", "--all", "--redis-url", url)
    passes = [json.loads(line) for line in gc.stdout.splitlines() if line.startswith("{")]
    assert scn.name in {p.get("namespace") for p in passes}, gc.stdout + gc.stderr
    # the namespace no run wrote is skipped, said, and fails the pass (cron sees it)
    skipped = [json.loads(line) for line in gc.stderr.splitlines() if "skipped" in line]
    assert [s["namespace"] for s in skipped] == [other], gc.stderr
    assert gc.returncode == 1
    connect = tag_clients(url)
    verify(scn, connect(scn.name), connect=connect)  # GC took nothing that matters


SAMPLED = os.path.join(os.path.dirname(PIPELINE), "sampled.py")


def _sampled_scenario(broker, url, tmp_path, cluster):
    """Events for ``sampled.py`` under a namespace whose master serves none of some of the
    count's scopes; returns the scenario, that master's port and those scopes' partitions."""
    for _ in range(100):
        name = f"sampled-{uuid.uuid4().hex[:8]}"
        home = cluster.slot_owner(namespace_slot(name)).port
        elsewhere = [
            p
            for p in range(2)
            if cluster.slot_owner(namespace_slot(_scope(name, p).tag)).port != home
        ]
        if elsewhere:
            break
    scn = Scenario(name, broker.bootstrap, url, str(tmp_path), Counter(), set())
    rng = random.Random(11)
    events = [
        {"event_id": str(uuid.uuid4()), "user": f"u{rng.randrange(17)}", "ts": BASE_TS + 50 * i}
        for i in range(2000)
    ]
    produce_sends(scn, [(e, i % 2) for i, e in enumerate(events)])
    return scn, home, elsewhere


def _scope(namespace: str, partition: int) -> Keyspace:
    return Keyspace(namespace, scope_name("count", partition))


def _sampled_counts(cluster: LocalRedisCluster, namespace: str) -> Counter:
    """Per user, the events the source stage's backups say it kept (its surviving decisions):
    the sums of the partial counts its tasks committed (``count/partial`` runs in it)."""
    home = Keyspace(namespace)
    owner = cluster.slot_owner(namespace_slot(namespace)).port
    client = redis_py.Redis(port=owner)  # bytes, on the master of the namespace's slot
    kept: Counter = Counter()
    for key in client.scan_iter(match=home.pattern(Kind.BACKUP), count=1000):
        parsed = home.parse(key)
        if parsed is not None and parsed.name == "events":
            for out in replay(client.hgetall(key)).outputs:
                if out.target >= 0:  # a task's partial counts (not its chunks' deltas)
                    kept[codec.decode(out.key)] += codec.decode(out.value)
    return kept


@pytest.mark.long  # ~2 minutes: the producer's wait holds the batch until the failover
def test_a_reader_on_another_master_never_keeps_outputs_their_producer_lost(
    broker, redis_cluster, tmp_path
):
    """The run-id fence orders writes per master only. The source stage (a random sample)
    commits on master A while A's replica lags; the count, on master B, commits what it read
    of them; then A fails over to that replica. The batch runs again and the sample is drawn
    anew where A lost it: the count must hold exactly what the source stage's surviving
    backups kept, not the first draw's records as well. A producer's task now waits for its
    commits to reach A's replica before its outputs are read, so the count never sees writes
    A can lose (it waits in vain here until A fails over, and the batch runs again)."""
    url = cluster_url(redis_cluster)
    scn, home, elsewhere = _sampled_scenario(broker, url, tmp_path, redis_cluster)
    connect = tag_clients(url)
    index = [m.port for m in redis_cluster.masters()].index(home)
    events: list[Any] = []

    def committed_elsewhere() -> bool:
        for p in elsewhere:
            ks = _scope(scn.name, p)
            owner = redis_cluster.slot_owner(namespace_slot(ks.tag)).port
            if redis_cluster.node_client(owner).exists(ks.backup("count", 1, p)):
                return True
        return False

    def fail_over_later(frozen: list[int]) -> None:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not committed_elsewhere():
            time.sleep(0.05)
        events.append(("count committed on another master", committed_elsewhere()))
        events.append(redis_cluster.kill_master(index))
        redis_cluster.resume_nodes(frozen)

    def cut_off_a() -> None:
        frozen = redis_cluster.cut_off_replicas(index)
        threading.Thread(target=fail_over_later, args=(frozen,), daemon=True).start()

    where = Crash("before_commit", stage="events", batch=1, partition=0, mode="pause")
    outcome = run_pipeline(SAMPLED, scn.args, env=scn.env, crash=where, fault=cut_off_a)
    deadline = time.monotonic() + 60
    while len(events) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(events) == 2, "the pause point was never reached:\n" + outcome.output[-3000:]
    killed = events[1]
    redis_cluster.wait_failover()
    print(f"[redis-cluster] {events[0]}; run: {outcome.output.splitlines()[:2]}")
    assert outcome.returncode == 0, outcome.output[-3000:]
    assert "running it again" in outcome.output, outcome.output[-3000:]
    kept = _sampled_counts(redis_cluster, scn.name)
    assert sum(kept.values()) > 0
    stored = node_state(connect(scn.name), scn.name, "count", connect)
    state = {codec.decode(k): codec.decode(v) for k, v in stored.items()}
    report = compare_counts(kept, state)
    assert report.ok, f"the count against what the sample kept: {report}"
    last: dict[str, int] = {}
    for rec in read_topic(KafkaSettings(scn.bootstrap), scn.topics["counts"]):
        last[rec.key.decode()] = json.loads(rec.value)
    assert last == dict(kept), "the counts topic against what the sample kept"
    redis_cluster.restart_node(killed.port)  # back as a replica, for the next test
