"""Records a sink refuses for good become dead letters, once each, and are never lost.

A refused record is not marked delivered: until its dead letter is durable, a retry must find
it undelivered, be refused again and make the same letter (same ID, so the dead-letter sink
takes it once). A record refused before it was sent is not refused again in a transaction
redone after a poison record (two letters with one ID reached the dead-letter sink).
A chunk redone after a commit conflict counts its dead letters once.
Sinks here are in-memory recorders of what became visible; dedup runs on a real Redis.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import replace

import pytest

from onceflow.connectors.base import (
    PoisonInTransaction,
    SinkConnector,
    SinkWriter,
    TransactionalWriter,
)
from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.kafka import KafkaSource
from onceflow.dedup.batch import BatchParams
from onceflow.dedup.config import DedupConfig
from onceflow.dedup.guard import ExactlyOnceGuards
from onceflow.kernel import codec
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.limits import DELIVERY_RECORDS
from onceflow.kernel.records import Output, TaskRef
from onceflow.kernel.settings import RedisSettings
from onceflow.pipeline import Pipeline
from onceflow.runtime.task.loop import TaskRun
from tests.dedup.test_guard import TS, _rows

pytestmark = pytest.mark.redis


class Recorder(SinkConnector):
    """A plain sink that keeps what it was given, refuses elements whose ``i`` is in
    ``refuse``, and fails its first ``failures`` writes (a broker that is briefly away)."""

    def __init__(self, refuse: Sequence[int] = (), failures: int = 0) -> None:
        self.refuse, self.failures = set(refuse), failures
        self.visible: list[tuple[bytes, object]] = []

    def describe(self) -> str:
        return "recorder"

    def open(self, task):
        return _Plain(self)


class _Plain(SinkWriter):
    def __init__(self, sink: Recorder) -> None:
        self.sink = sink

    def write(self, records):
        if self.sink.failures:
            self.sink.failures -= 1
            raise ConnectorError("the sink is away")
        refused = []
        for r in records:
            if isinstance(r.elem, dict) and r.elem.get("i") in self.sink.refuse:
                refused.append((r, "refused: too big"))
            else:
                self.sink.visible.append((r.id, r.elem))
        return refused


class Transactional(SinkConnector):
    """Refuses ``too_big`` before sending; the broker refuses ``poison`` once at prepare."""

    def __init__(self, too_big: int, poison: int) -> None:
        self.too_big, self.poison = too_big, poison
        self.visible: list[tuple[bytes, object]] = []
        self.poisoned = False

    def describe(self) -> str:
        return "transactional recorder"

    def open(self, task):
        return _Txn(self)


class _Txn(TransactionalWriter):
    def __init__(self, sink: Transactional) -> None:
        self.sink, self.open_txn = sink, []

    @property
    def identity(self) -> str:
        return "recorder-1"

    def settle(self, identities: Sequence[str]) -> None:
        self.open_txn = []

    def write(self, records):
        refused = []
        for r in records:
            if r.elem["i"] == self.sink.too_big:
                refused.append((r, "too big"))
            else:
                self.open_txn.append(r)
        return refused

    def prepare(self, mark=None) -> str:
        bad = [r for r in self.open_txn if r.elem["i"] == self.sink.poison]
        if bad and not self.sink.poisoned:
            self.sink.poisoned = True
            self.open_txn = []
            raise PoisonInTransaction([(bad[0], "the broker refused it")])
        return "marker"

    def commit(self) -> None:
        self.sink.visible.extend((r.id, r.elem) for r in self.open_txn)
        self.open_txn = []

    def committed(self, marker: str) -> bool:
        return False


def _stage(redis_server, sink, dead):
    name = f"refused-{uuid.uuid4().hex[:8]}"
    p = Pipeline(name, dead_letters=dead)
    p.read("events", KafkaSource("in", bootstrap_servers="127.0.0.1:1")).map(
        "same", lambda e: e
    ).write("out", sink)
    spec = p.job().stages[0].with_dead_letters(dead)
    redis_server.client().incr(Keyspace(name).epoch)
    params = BatchParams(0, TS, TS, TS, 24 * 3_600_000, 0, 0, (0,), TS * 2)
    guards = ExactlyOnceGuards(RedisSettings(redis_server.url), name, 1, DedupConfig())
    return spec, guards.for_batch(params)


def _committed_chunk(spec, guards, n, seed):
    """An attempt that committed a chunk of ``n`` records (``{"i": 0..n-1}``) as its outputs."""
    rows = _rows(n, seed)
    outs = [Output(0, rid, ts, None, codec.encode(elem)) for _p, rid, ts, _k, elem in rows]
    task = TaskRun(spec, guards, TaskRef(spec.name, 0, 0, 0, spec.sinks, 1))
    task.guard.open()
    assert task.guard.commit(0, rows, outs, {}, {}) == set()
    return task, outs


def _deliver(task: TaskRun, outs: list) -> list:
    """Hand a chunk's outputs over and deliver them now (a task holds them till its end)."""
    return [*task.emit(outs), *task.release()]


def test_a_refused_record_whose_dead_letter_failed_is_refused_again_on_retry(redis_server):
    sink, dead = Recorder(refuse={3}), Recorder(failures=1)
    spec, guards = _stage(redis_server, sink, dead)
    first, outs = _committed_chunk(spec, guards, 5, 7)
    with pytest.raises(ConnectorError):  # the dead-letter sink was away: the task is retried
        _deliver(first, outs)
    first.close(False)
    retry = TaskRun(spec, guards, TaskRef(spec.name, 0, 0, 0, spec.sinks, 2))
    list(retry.run(iter([])))  # replays the backup
    retry.close(True)
    assert sorted(e["i"] for _id, e in sink.visible) == [0, 1, 2, 4]
    assert [json.loads(e["value"]) for _id, e in dead.visible] == [{"i": 3}]
    dead_sink = spec.targets[spec.dead_target].name
    pending = Keyspace(spec.pipeline).pending(f"{dead_sink}/delivered", 0)
    assert not redis_server.client().exists(pending), "no delivery left pending"


def test_a_record_refused_before_sending_is_one_dead_letter_after_a_poisoned_transaction(
    redis_server,
):
    sink, dead = Transactional(too_big=1, poison=2), Recorder()
    spec, guards = _stage(redis_server, sink, dead)
    task, outs = _committed_chunk(spec, guards, 4, 9)
    _deliver(task, outs)
    task.close(True)
    assert sorted(e["i"] for _id, e in sink.visible) == [0, 3]
    letters = sorted(json.loads(e["value"])["i"] for _id, e in dead.visible)
    assert letters == [1, 2], "one letter per refused record"
    assert len({rid for rid, _e in dead.visible}) == 2


def test_a_chunk_redone_after_a_conflict_counts_its_dead_letters_once(redis_server):
    def fails_on_one(e):
        if e["i"] == 1:
            raise ValueError("bad record")
        return e

    name = f"redo-{uuid.uuid4().hex[:8]}"
    p = Pipeline(name)
    p.read("events", KafkaSource("in", bootstrap_servers="127.0.0.1:1")).map(
        "check", fails_on_one
    ).write("out", Recorder())
    spec = p.job().stages[0]
    redis_server.client().incr(Keyspace(name).epoch)
    params = BatchParams(0, TS, TS, TS, 24 * 3_600_000, 0, 0, (0,), TS * 2)
    guards = ExactlyOnceGuards(RedisSettings(redis_server.url), name, 1, DedupConfig())
    guards = guards.for_batch(params)
    rows = _rows(5, 11)
    task = TaskRun(spec, guards, TaskRef(spec.name, 0, 0, 0, spec.sinks, 1))
    task.guard.open()
    other = TaskRun(spec, guards, TaskRef(spec.name, 0, 1, 0, spec.sinks, 2))
    other.guard.open()
    assert other.guard.commit(0, [rows[3]], [], {}, {}) == set()  # a copy, committed meanwhile
    task.commits.attempt(0, rows, [], {})
    assert task.counters.get("events/commit_conflicts") == 1, "the chunk was redone"
    assert task.body.dead_count == 1 and task.body.dead_codes == {"user_error": 1}


def _raw_rows(values: list[bytes]):
    """A Kafka source's raw rows (topic ``in``, partition 0, offsets 0..)."""
    import pyarrow as pa

    n = len(values)
    columns = {
        "topic": pa.array(["in"] * n, pa.string()),
        "partition": pa.array([0] * n, pa.int32()),
        "offset": pa.array(range(n), pa.int64()),
        "ts": pa.array([TS + i for i in range(n)], pa.int64()),
        "key": pa.array([None] * n, pa.binary()),
        "value": pa.array(values, pa.binary()),
        "headers": pa.array([None] * n, pa.binary()),
    }
    return pa.RecordBatch.from_pydict(columns)


@pytest.mark.parametrize("hold", [DELIVERY_RECORDS, 1], ids=["one-delivery", "two-deliveries"])
def test_a_dead_letter_committed_by_an_attempt_that_died_is_delivered_once(
    hold, redis_server, monkeypatch
):
    """The retry replays the letter from the backup and makes it again from its input (an
    undecodable record is no admitted input): two copies with one ID, delivered once, in
    one delivery or in two (``hold``: sink records the retry holds before delivering)."""
    sink, dead = Recorder(), Recorder()
    spec, guards = _stage(redis_server, sink, dead)
    values = [json.dumps({"i": i}).encode() for i in range(5)]
    values[2] = b"{not json"
    first = TaskRun(spec, guards, TaskRef(spec.name, 0, 0, 0, spec.sinks, 1))

    def killed(_task):
        raise RuntimeError("killed after its chunk committed, before delivering what it held")

    with monkeypatch.context() as m:
        m.setattr(TaskRun, "close_counts", killed)
        with pytest.raises(RuntimeError, match="killed"):
            list(first.run(iter([_raw_rows(values)])))
    first.close(False)
    assert not sink.visible and not dead.visible
    held = replace(guards, config=replace(guards.config, delivery_records=hold))
    retry = TaskRun(spec, held, TaskRef(spec.name, 0, 0, 0, spec.sinks, 2))
    list(retry.run(iter([_raw_rows(values)])))
    retry.close(True)
    assert sorted(e["i"] for _id, e in sink.visible) == [0, 1, 3, 4]
    assert len(dead.visible) == 1, "one letter for the undecodable record"
