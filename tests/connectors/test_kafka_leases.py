"""Worker leases: each worker process of a machine writes a partition under its own id.

The lease (no Kafka): two live processes never share a lease number, and a killed one's
number is taken again. Against a real Kafka and Redis, through the runtime's delivery code:
a zombie attempt under one lease has prepared a delivery when a new attempt under another
takes the partition over; the new attempt settles the zombie's id (recorded in Redis before its
transaction began), resolves the pending delivery and delivers; the zombie's commit then
fails, and a ``read_committed`` reader sees each record once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import uuid

import pytest

from onceflow.connectors.kafka import KafkaSink, KafkaSource, leases, transactional_writer
from onceflow.connectors.kafka.clients import WORKER_CLIENTS
from onceflow.connectors.kafka.topics import read_topic
from onceflow.connectors.kafka.transactional_producers import _TXN_PRODUCERS
from onceflow.dedup.batch import BatchParams
from onceflow.dedup.config import DedupConfig
from onceflow.dedup.guard import ExactlyOnceGuards
from onceflow.kernel import codec
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.records import Output, TaskRef
from onceflow.kernel.settings import RedisSettings
from onceflow.pipeline import Pipeline
from onceflow.runtime.faults import CrashPoint
from onceflow.runtime.ops.body import StageBody
from onceflow.runtime.task.sink_delivery import SinkDelivery

CLIENTS = pytest.mark.parametrize("client", WORKER_CLIENTS)


def _holder(prefix: str) -> tuple[int, int]:
    """A forked worker process holding its lease until killed: its pid and lease number."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns into pytest
        try:
            os.close(read)
            os.write(write, str(leases.worker_lease(prefix)).encode())
            signal.pause()  # hold the lease until killed
        finally:
            os._exit(0)
    os.close(write)
    number = int(os.read(read, 16) or b"-1")
    os.close(read)
    return pid, number


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, ChildProcessError):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_live_processes_hold_different_lease_numbers_and_a_killed_ones_is_taken_again():
    prefix = f"onceflow.leases-{uuid.uuid4().hex[:8]}"
    pids: list[int] = []
    try:
        first, a = _holder(prefix)
        second, b = _holder(prefix)
        pids += [first, second]
        _kill(first)  # kill -9: the operating system releases its lease
        third, c = _holder(prefix)
        pids.append(third)
        assert (a, b, c) == (0, 1, 0), "the lowest free number each; a killed one's is free"
    finally:
        for pid in pids:
            _kill(pid)


def test_a_forked_child_takes_its_own_lease_and_the_parent_keeps_its():
    prefix = f"onceflow.fork-{uuid.uuid4().hex[:8]}"
    mine = leases.worker_lease(prefix)
    child, theirs = _holder(prefix)  # inherits the parent's lease, leases its own
    _kill(child)  # and its copy of the parent's lease file goes with it
    other, number = _holder(prefix)
    _kill(other)
    assert (mine, theirs, number) == (0, 1, 1), "the parent's lease outlived the child"


def test_a_process_keeps_a_bounded_number_of_leases_and_frees_the_oldest():
    run = uuid.uuid4().hex[:8]
    prefixes = [f"onceflow.many-{run}-{i}" for i in range(leases.MAX_LEASES + 1)]
    for prefix in prefixes:
        assert leases.worker_lease(prefix) == 0
    mine = [p for p in leases._LEASES if p.startswith(f"onceflow.many-{run}-")]
    assert mine == prefixes[1:], "the least recently used lease was let go"
    assert len(leases._LEASES) <= leases.MAX_LEASES
    first, number = _holder(prefixes[0])  # its number 0 is free again
    second, kept = _holder(prefixes[-1])  # still held here
    _kill(first)
    _kill(second)
    assert (number, kept) == (0, 1)


# -- a zombie under another lease, through the runtime's delivery code -----------------------

TS = 1_790_000_000_000
N = 40


class Killed(Exception):
    """The zombie stops at a crash point (paused, or its process killed)."""


class _Partition:
    """One sink partition of a pipeline with a real Kafka sink and a real Redis guard."""

    def __init__(self, redis_server, bootstrap: str, topic: str, client: str) -> None:
        self.name = f"leases-{uuid.uuid4().hex[:8]}"
        redis_server.client().incr(Keyspace(self.name).epoch)
        redis = RedisSettings(redis_server.url)
        self.guards = ExactlyOnceGuards(redis, self.name, 1, DedupConfig())
        p = Pipeline(self.name)
        source = KafkaSource("in", bootstrap_servers=bootstrap)  # never read here
        sink = KafkaSink(topic, bootstrap_servers=bootstrap, client=client)
        p.read("events", source).map("same", lambda e: e).write("out", sink)
        self.spec = p.job().stages[0]
        self.index = self.spec.sinks[0][0]
        self.target = self.spec.targets[self.index]
        self.target.connector.prepare(self.name, streaming=True)

    def attempt(self, attempt_id: int, crash_at: CrashPoint | None = None) -> SinkDelivery:
        ref = TaskRef(self.spec.name, 1, 0, 0, self.spec.sinks, attempt_id)
        params = BatchParams(1, TS, TS, 0, 24 * 3_600_000, 0, 0, (0,), TS * 2)
        guard = self.guards.for_batch(params)(ref)
        guard.open()  # claims the partition: an older attempt's fenced calls fail from now

        def crash(point: CrashPoint) -> None:
            if point is crash_at:
                raise Killed(point)

        body = StageBody(self.spec, guard.mode, ref.batch, ref.partition)  # makes no records
        return SinkDelivery(self.spec, guard, body, ref, lambda *_: None, crash)

    def outputs(self) -> list[Output]:
        return [
            Output(self.index, uuid.uuid4().bytes, TS, None, codec.encode({"i": i}))
            for i in range(N)
        ]


@pytest.mark.kafka
@pytest.mark.redis
@CLIENTS
@pytest.mark.parametrize(
    "left_at",
    [CrashPoint.AFTER_SINK_WRITE, CrashPoint.IN_SINK_TRANSACTION],
    ids=["pending-delivery", "open-transaction"],
)
def test_a_new_attempt_under_another_lease_settles_the_zombies_transaction(
    client, left_at, redis_server, kafka_broker, topic_name, monkeypatch
):
    """The zombie (lease 0) stopped with its transaction open, its id recorded in Redis.

    ``pending-delivery``: it had also recorded the delivery as pending (marker sent), and
    commits when it wakes up; ``open-transaction``: it had only sent records. Either way the
    new attempt (lease 1) must end that transaction before reading the marker or writing:
    else the marker read waits for it (up to the outage bound) and readers are held back.
    """
    monkeypatch.setenv("ONCEFLOW_KAFKA_OUTAGE_WAIT", "20s")  # a wait that should not happen
    topic = topic_name("leases")
    part = _Partition(redis_server, kafka_broker.bootstrap, topic, client)
    lease = [0]
    monkeypatch.setattr(transactional_writer, "worker_lease", lambda _prefix: lease[0])
    outs = part.outputs()

    zombie = part.attempt(attempt_id=10, crash_at=left_at)
    with pytest.raises(Killed):
        zombie.deliver(part.target, outs)
    stuck = zombie.writers[part.index]
    stuck.producer.flush(30)  # its records are in the log, in its open transaction
    _TXN_PRODUCERS.clear()  # its producer lives on in the zombie's own process

    lease[0] = 1  # Spark ran the retry in another worker process
    owner = part.attempt(attempt_id=11)
    assert owner.deliver(part.target, outs) == []
    owner.close(ok=True)
    assert owner.writers[part.index].identity != stuck.identity, "two leases, two ids"

    if left_at is CrashPoint.AFTER_SINK_WRITE:
        with pytest.raises(Exception):  # noqa: B017 - fenced: each client names it its own way
            stuck.commit()  # the zombie wakes up: its transaction was ended
    seen = read_topic(part.target.connector.settings, topic)
    ids = [r.headers["onceflow-id"] for r in seen]
    assert sorted(ids) == sorted(o.id for o in outs), "each record once, read_committed"


@pytest.mark.kafka
@pytest.mark.redis
@CLIENTS
def test_a_zombie_never_registers_its_id_again_after_a_retry_settled_it(
    client, redis_server, kafka_broker, topic_name, monkeypatch
):
    """Redis confirmed the zombie's writer (its last fenced call) a moment before a retry in
    another lease took the partition over and settled the zombie's id. The zombie goes on to
    its transaction: it must not register its id again (a process here knows from the note
    that another registered it), or it opens a transaction nobody settles, and if it then
    dies read_committed readers stall behind it until Kafka's transaction timeout (60 s).
    The retry's next delivery must be readable at once."""
    monkeypatch.setenv("ONCEFLOW_KAFKA_OUTAGE_WAIT", "20s")
    topic = topic_name("zombie-again")
    part = _Partition(redis_server, kafka_broker.bootstrap, topic, client)
    lease = [0]
    monkeypatch.setattr(transactional_writer, "worker_lease", lambda _prefix: lease[0])
    earlier = part.attempt(attempt_id=9)  # an earlier task of the zombie's process
    assert earlier.deliver(part.target, part.outputs()) == []
    earlier.close(ok=True)
    zombie_tid = earlier.writers[part.index].identity
    zombies_producer = _TXN_PRODUCERS[zombie_tid]  # what the zombie's process keeps

    zombie = part.attempt(attempt_id=10)
    zombie_guard = zombie.guard
    noted = zombie_guard.note_writer
    owner: list[SinkDelivery] = []

    def retry_takes_over() -> None:
        """A retry under lease 1 claims the partition, settles the zombie's id and delivers."""
        lease[0] = 1
        owner.append(part.attempt(attempt_id=11))
        assert owner[0].deliver(part.target, part.outputs()) == []
        lease[0] = 0
        _TXN_PRODUCERS[zombie_tid] = zombies_producer  # the zombie's process still has it

    def note_then_lose(target, identity, begins=True):
        noted(target, identity, begins)  # confirmed: the zombie still owned the partition
        if not owner:
            retry_takes_over()

    monkeypatch.setattr(zombie_guard, "note_writer", note_then_lose)
    with pytest.raises(Exception):  # noqa: B017 - fenced (Redis, or Kafka first)
        zombie.deliver(part.target, part.outputs())
    # the zombie dies here: nothing of it is closed or aborted
    later = part.outputs()
    assert owner[0].deliver(part.target, later) == []
    seen = read_topic(part.target.connector.settings, topic, timeout=20)
    ids = {r.headers["onceflow-id"] for r in seen}
    stalled = [o.id for o in later if o.id not in ids]
    assert not stalled, f"{len(stalled)} committed records held back by the zombie's transaction"
    owner[0].close(ok=True)
