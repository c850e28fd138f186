"""Plan changes: what counts as one, and when ``--accept-plan-change`` is refused.

A replayed batch finds its tasks' backups by task number; the numbers are a union's
partition indexes, which another plan (a stage added, a source added) gives otherwise: the
replay would read other tasks' backups (their positional inputs counted twice, their
deliveries made again). So a change waits until no started batch is unacknowledged.

Another combiner on a stage is a change too: it would merge with the state the old one wrote.
"""

from __future__ import annotations

import uuid

import pytest

from onceflow.connectors.kafka import KafkaSink, KafkaSource
from onceflow.kernel.keyspace import Keyspace
from onceflow.pipeline import Pipeline
from onceflow.pipeline.combiners import CombineFn, Sum
from onceflow.runtime.driver.pinning import PLAN_FIELD, in_flight, pin_plan
from onceflow.runtime.errors import PlanChangedError

pytestmark = pytest.mark.redis


def _job(name, extra_stage):
    p = Pipeline(name)
    events = p.read("events", KafkaSource("in", bootstrap_servers="127.0.0.1:1"))
    if extra_stage:
        events = events.filter("non-empty", bool)
    events.map("same", lambda e: e).write("out", KafkaSink("out", bootstrap_servers="x:1"))
    return p.job()


def test_a_plan_change_waits_for_the_batch_in_flight(redis_server):
    client = redis_server.client()
    name = f"plan-{uuid.uuid4().hex[:6]}"
    ks = Keyspace(name)
    pin_plan(client, ks, _job(name, False), 2, False)
    stored = client.hget(ks.meta, PLAN_FIELD)
    client.set(ks.acked, 3)
    client.hset(ks.batch(4), "time_ms", 1)  # batch 4 started, the run died in it
    assert in_flight(client, ks) == 4
    changed = _job(name, True)
    with pytest.raises(PlanChangedError, match="micro-batch 4 in flight"):
        pin_plan(client, ks, changed, 2, True)
    assert client.hget(ks.meta, PLAN_FIELD) == stored, "the refused plan was stored"
    client.set(ks.acked, 4)  # the old plan finished it
    assert in_flight(client, ks) is None
    pin_plan(client, ks, changed, 2, True)
    assert client.hget(ks.meta, PLAN_FIELD) != stored


def test_at_least_once_keeps_no_backups_to_replay(redis_server):
    client = redis_server.client()
    name = f"plan-alo-{uuid.uuid4().hex[:6]}"
    ks = Keyspace(name)
    pin_plan(client, ks, _job(name, False), 2, False, exactly_once=False)
    client.hset(ks.batch(7), "time_ms", 1)
    pin_plan(client, ks, _job(name, True), 2, True, exactly_once=False)


class TopK(CombineFn):
    """A user's combiner whose arguments do not change its state's format."""

    def __init__(self, k):
        self.k = k


class Newest(CombineFn):
    """Another user's combiner."""


def _combining(name, combiner):
    p = Pipeline(name)
    (
        p.read("events", KafkaSource("in", bootstrap_servers="127.0.0.1:1"))
        .key_by("by-user", lambda e: e["user"])
        .combine_per_key("revenue", combiner)
        .write("out", KafkaSink("out", bootstrap_servers="x:1"))
    )
    return p.job()


@pytest.mark.parametrize(
    ("first", "then"),
    [("sum", "mean"), (TopK(5), Newest()), ("sum", TopK(5))],
    ids=["built-in", "class", "built-in-to-class"],
)
def test_another_combiner_is_a_plan_change(redis_server, first, then):
    client = redis_server.client()
    name = f"plan-fn-{uuid.uuid4().hex[:6]}"
    ks = Keyspace(name)
    pin_plan(client, ks, _combining(name, first), 2, False)
    stored = client.hget(ks.meta, PLAN_FIELD)
    with pytest.raises(PlanChangedError, match="keyed state removed: revenue") as refused:
        pin_plan(client, ks, _combining(name, then), 2, False)
    assert "--accept-plan-change" in str(refused.value)
    assert client.hget(ks.meta, PLAN_FIELD) == stored, "the refused plan was stored"
    pin_plan(client, ks, _combining(name, then), 2, True)  # the escape still works
    pin_plan(client, ks, _combining(name, then), 2, False)  # and the new one is now pinned


@pytest.mark.parametrize(
    ("first", "then"),
    [("sum", "sum"), ("sum", Sum()), (TopK(5), TopK(10))],
    ids=["built-in", "built-in-instance", "arguments"],
)
def test_the_same_combiner_is_the_same_plan(redis_server, first, then):
    client = redis_server.client()
    name = f"plan-fn-{uuid.uuid4().hex[:6]}"
    ks = Keyspace(name)
    pin_plan(client, ks, _combining(name, first), 2, False)
    pin_plan(client, ks, _combining(name, then), 2, False)
