"""A Redis that goes back is a clear stop or a rerun, never a wrong answer.

Against a real Redis whose *host* crashes (``onceflow.testing.hostcrash``: the server is
killed and its AOF cut back to what it had fsynced, ``appendfsync everysec``):

* a task that began on a server must not write on the server that came back: what it wrote
  before may be gone, and writing on top would leave a state that is no prefix of what was
  written (chunk 2 without chunk 1). Every fenced script refuses it (``ServerChangedError``);
* the driver's end-of-batch wait sees the server changed and refuses to let Spark commit;
* a Redis whose durable marker is behind Spark's last committed batch is refused with what
  happened and what to do.
"""

from __future__ import annotations

import random

import pytest
import redis as redis_py

from onceflow.dedup.batch import fix_batch_params
from onceflow.dedup.config import DedupConfig
from onceflow.dedup.durability import (
    BatchDurability,
    Durability,
    check_markers,
    inherit_markers,
    plan_durability,
    wait_durable,
)
from onceflow.dedup.errors import RedisBehindError, ServerChangedError
from onceflow.kernel.errors import ServiceError
from onceflow.kernel.eventtime import EventTime
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.records import StateWrite
from onceflow.kernel.scopes import pin_scopes
from onceflow.testing.services import LocalRedis
from tests.dedup.test_guard import Harness, _rows

pytestmark = pytest.mark.redis


class _Service:
    def __init__(self, server: LocalRedis) -> None:
        self.url = server.url

    def client(self):
        return redis_py.Redis.from_url(self.url)


@pytest.fixture
def crashable(crashable_redis):
    return crashable_redis


def _fsync(h):
    """Make everything so far durable: what the crash takes is then only what follows."""
    assert h.client.execute_command("WAITAOF", 1, 0, 5000)[0] == 1


def _harness(server):
    """A guard harness whose batches carry the server's run id, as the driver's do."""
    h = Harness(_Service(server), snapshot_every=1000)
    run_id = h.client.info("server")["run_id"]
    h.guards = h.guards.for_batch(
        h.params(0), BatchDurability({h.name: 0}, {h.name: run_id}, waitaof=False)
    )
    return h


def test_a_task_does_not_write_on_a_server_that_came_back_after_a_host_crash(crashable):
    h = _harness(crashable)
    g = h.task(batch=0)
    _fsync(h)  # the epoch and the task's claim survive: only the server check is left
    first, second = _rows(50, 1), _rows(50, 2)
    assert g.commit(0, g.admit(first).fresh, [], {}, {}) == set()
    cut = crashable.crash_host()  # nothing fsynced the commit: the crash takes it
    assert crashable.lost_bytes() > 0, f"the crash lost nothing: {cut}"
    ks = Keyspace(h.name)
    assert not h.client.hgetall(ks.backup(h.spec.name, 0, 0)), "chunk 0 should be gone"
    with pytest.raises(ServerChangedError, match="restarted or failed over during micro-batch 0"):
        g.commit(1, g.admit(second).fresh, [], {"n": StateWrite({b"k": b"1"})}, {})
    assert not h.client.hgetall(ks.backup(h.spec.name, 0, 0)), "chunk 1 written without chunk 0"


def test_without_the_server_check_the_task_would_write_on_top(crashable):
    """The same crash with a task that checks no server: chunk 1 lands without chunk 0."""
    h = Harness(_Service(crashable), snapshot_every=1000)  # batches without a run id
    g = h.task(batch=0)
    _fsync(h)
    assert g.commit(0, g.admit(_rows(50, 3)).fresh, [], {}, {}) == set()
    crashable.crash_host()
    g.commit(1, g.admit(_rows(50, 4)).fresh, [], {}, {})
    fields = h.client.hkeys(Keyspace(h.name).backup(h.spec.name, 0, 0))
    assert b"c1" in fields and b"c0" not in fields, fields


def test_every_fenced_script_refuses_another_server(crashable):
    """Claim, commit, finish, pending delivery, writer note and delivery log all check it."""
    h = _harness(crashable)
    g = h.task(batch=0)
    _fsync(h)
    crashable.crash_host()
    s = g.session
    calls = {
        "commit": lambda: g.commit(0, g.admit(_rows(5, 5)).fresh, [], {}, {}),
        "finish": lambda: g.finish([], {}),
        "prepare": lambda: g.prepare_delivery(0, "m", []),
        "note_writer": lambda: g.note_writer(0, "w"),
        "claim": g.open,
    }
    for name, call in calls.items():
        with pytest.raises(ServerChangedError):
            call()
        assert s.counters is not None, name


def test_batch_parameters_are_not_fixed_on_another_server(crashable):
    client = redis_py.Redis.from_url(crashable.url)
    ks = Keyspace("params-fence")
    client.incr(ks.epoch)
    run_id = client.info("server")["run_id"]
    client.execute_command("WAITAOF", 1, 0, 5000)  # the epoch survives the crash
    crashable.crash_host()
    with pytest.raises(ServerChangedError):
        fix_batch_params(client, ks, 1, 0, DedupConfig(), EventTime(), run_id)
    assert not client.exists(ks.batch(0))


def test_the_end_of_batch_wait_refuses_a_server_that_changed(crashable):
    client = redis_py.Redis.from_url(crashable.url)
    ks = Keyspace("wait-fence")
    durability = Durability(waitaof=True, replicas=0)
    this_batch = durability.for_batch([(ks.tag, client)])
    wait_durable([(ks, client)], 0, durability, this_batch)  # the same server: fine
    assert int(client.hget(ks.clock, "durable")) == 0
    crashable.crash_host()
    with pytest.raises(ServerChangedError, match="micro-batch 1"):
        wait_durable([(ks, client)], 1, durability, this_batch)


def test_a_marker_behind_what_spark_committed_is_a_clear_stop(redis_server):
    client = redis_server.client()
    ks = Keyspace("markers-behind")
    client.hset(ks.clock, "durable", 6)
    check_markers([(ks, client)], 6, ks.namespace)  # equal: fine
    check_markers([(ks, client)], None, ks.namespace)  # nothing committed: fine
    with pytest.raises(RedisBehindError, match="micro-batches 7 to 9 cannot be made exact"):
        check_markers([(ks, client)], 9, ks.namespace)
    other = Keyspace("markers-none")
    check_markers([(other, client)], 9, other.namespace)  # no marker yet: says nothing
    with pytest.raises(RedisBehindError, match="has no durable marker"):
        check_markers([(other, client)], 9, other.namespace, marked=True)  # this driver's


def test_a_tag_without_a_marker_beside_tags_with_one_lost_its_keys(redis_server):
    """A scope whose master came back empty: no marker where every tag had one."""
    client = redis_server.client()
    home, scope = Keyspace("markers-gone"), Keyspace("markers-gone", "abc.0")
    client.hset(home.clock, "durable", 4)
    with pytest.raises(RedisBehindError, match=r"hash tag markers-gone:abc\.0 has no durable"):
        check_markers([(home, client), (scope, client)], 4, home.namespace)


def test_a_scope_a_plan_change_adds_is_as_durable_as_the_namespace(redis_server):
    """Stages new to the plan (--accept-plan-change) get scopes with the namespace's marker
    before the namespace lists them, so the next start does not take them as emptied."""
    client = redis_server.client()
    home = Keyspace("markers-plan")
    pin_scopes(client, home, ["count"], ["read", "count"], frozenset(), 2, new=True)
    client.hset(home.clock, "durable", 7)
    added: list[Keyspace] = []

    def inherit(scopes: list[Keyspace]) -> None:
        added.extend(scopes)
        inherit_markers((home, client), [(ks, client) for ks in scopes])

    stages = ["read", "count", "sum"]
    scopes = pin_scopes(
        client,
        home,
        ["count", "sum"],
        stages,
        frozenset(stages[:2]),
        2,
        new=False,
        on_added=inherit,
    )
    assert [ks.tag for ks in added] == [scopes.keyspace("sum", p).tag for p in range(2)]
    targets = [(ks, client) for ks in scopes.keyspaces()]
    for ks in scopes.keyspaces():
        if ks.tag not in {a.tag for a in added}:
            client.hset(ks.clock, "durable", 7)
    check_markers(targets, 7, home.namespace)  # fine: the new scopes hold 7


def test_what_a_waitaof_confirmed_survives_a_host_crash_and_the_rest_may_not(crashable):
    """The simulator's own check: it loses exactly what was not fsynced."""
    client = redis_py.Redis.from_url(crashable.url)
    for i in range(200):
        client.set(f"kept-{i}", i)
    pipe = client.pipeline(transaction=False)
    pipe.set("confirmed", 1)
    pipe.execute_command("WAITAOF", 1, 0, 5000)
    assert pipe.execute()[1][0] == 1
    for i in range(2000):
        client.set(f"later-{i}", i)
    crashable.crash_host(random.Random(3))
    assert client.get("confirmed") == b"1" and client.get("kept-199") == b"199"
    assert client.dbsize() < 2201, "an everysec host crash right after writes loses some"


def test_a_redis_that_cannot_confirm_fsync_is_refused_unless_allowed(redis_factory):
    """Debian's Redis 7.0 with everysec, no replica: refused; always, or the flag: fine."""
    server = redis_factory()
    client = redis_py.Redis.from_url(server.url)
    assert plan_durability([client], None, 1000).waitaof is False  # always: nothing to ask
    assert plan_durability([client], None, 1000).unconfirmed is False
    client.config_set("appendfsync", "everysec")
    version = tuple(int(p) for p in client.info("server")["redis_version"].split(".")[:2])
    if version >= (7, 2):
        pytest.skip("this Redis can confirm fsyncs")
    with pytest.raises(ServiceError, match="allow-unconfirmed-fsync"):
        plan_durability([client], None, 1000)
    allowed = plan_durability([client], None, 1000, allow_unconfirmed=True)
    assert allowed.waitaof is False and allowed.unconfirmed is True  # said at the start
