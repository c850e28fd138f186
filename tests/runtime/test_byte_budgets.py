"""A task's units bounded by bytes, without Spark: commits, deliveries, Arrow batches, slices.

A source stage reads raw Kafka rows (no broker: the rows are handed in as Spark would) and
writes an in-memory sink; commits go to a real Redis. Each budget here is the smallest one
accepted (64 KiB) and the records are tens of KB, so a handful of records fills it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pytest

from onceflow import Pipeline, sinks, sources
from onceflow.connectors.kafka import KafkaSource
from onceflow.dedup.batch import BatchParams
from onceflow.dedup.config import DedupConfig
from onceflow.dedup.guard import ExactlyOnceGuards
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.limits import Budget, outputs_bytes
from onceflow.kernel.records import Output, TaskRef
from onceflow.kernel.settings import RedisSettings
from onceflow.runtime.guard import no_guard
from onceflow.runtime.spec import StageSpec
from onceflow.runtime.task.loop import TaskRun
from tests.dedup.test_guard import TS
from tests.exactly_once.test_held_delivery import Counted
from tests.exactly_once.test_refused_records import Recorder, _raw_rows

pytestmark = pytest.mark.redis
BUDGET = 64 * 1024
KB = 1000


def _stage(
    redis_server,
    build: Callable[[Any], Any],
    sink: Any,
    dead: Recorder,
    max_record_bytes: int = BUDGET,
    **config: int,
) -> tuple[StageSpec, ExactlyOnceGuards]:
    """A source stage ``events -> build(...) -> sink`` and its guards for micro-batch 0."""
    name = f"bytes-{uuid.uuid4().hex[:8]}"
    p = Pipeline(
        name,
        dead_letters=dead,
        max_record_bytes=max_record_bytes,
        dedup=DedupConfig(**{"chunk_bytes": BUDGET, **config}),
    )
    build(p.read("events", KafkaSource("in", bootstrap_servers="127.0.0.1:1"))).write("out", sink)
    spec = p.job().stages[0].with_dead_letters(dead)
    redis_server.client().incr(Keyspace(name).epoch)
    params = BatchParams(0, TS, TS, TS, 24 * 3_600_000, 0, 0, (0,), TS * 2)
    guards = ExactlyOnceGuards(RedisSettings(redis_server.url), name, 1, p.dedup)
    return spec, guards.for_batch(params)


def _values(n: int, size: int) -> list[bytes]:
    return [json.dumps({"i": i, "body": "b" * size}).encode() for i in range(n)]


def _attempt(spec, guards, n: int) -> TaskRun:
    return TaskRun(spec, guards, TaskRef(spec.name, 0, 0, 0, spec.sinks, n))


def _backup(redis_server, spec) -> dict[bytes, bytes]:
    return redis_server.client().hgetall(Keyspace(spec.pipeline).backup(spec.name, 0, 0))


def _chunk_fields(backup: dict[bytes, bytes]) -> list[bytes]:
    return sorted((f for f in backup if f.startswith(b"c")), key=lambda f: int(f[1:]))


def _seen(sink) -> list[int]:
    return sorted(e["i"] for _id, e in sink.visible)


def test_a_chunk_is_cut_by_the_bytes_of_its_inputs(redis_server):
    """Ten records of 20 KB: three per commit of 64 KiB, four commits."""
    sink = Recorder()
    spec, guards = _stage(redis_server, lambda s: s.map("same", lambda e: e), sink, Recorder())
    task = _attempt(spec, guards, 1)
    list(task.run(iter([_raw_rows(_values(10, 20 * KB))])))
    task.close(True)
    backup = _backup(redis_server, spec)
    assert [len(backup[f.replace(b"c", b"i", 1)]) // 16 for f in _chunk_fields(backup)] == [
        3,
        3,
        3,
        1,
    ]
    assert max(len(backup[f]) for f in _chunk_fields(backup)) <= BUDGET
    assert _seen(sink) == list(range(10))


def test_a_function_that_grows_records_commits_its_chunk_in_parts_and_a_retry_is_exact(
    redis_server, monkeypatch
):
    """Ten small records each grown to 30 KB: one chunk of input, its writes committed in
    parts of at most 64 KiB; an attempt that dies after two parts is retried exactly."""
    sink = Counted()
    grow = lambda s: s.map("grow", lambda e: {**e, "pad": "p" * 30 * KB})  # noqa: E731
    spec, guards = _stage(redis_server, grow, sink, Recorder())
    rows = _raw_rows(_values(10, 10))
    first = _attempt(spec, guards, 1)
    commit, calls = first.guard.commit, []

    def dies_on_the_third(*args: Any, **kwargs: Any) -> set[bytes]:
        calls.append(args[0])
        if len(calls) == 3:
            raise RuntimeError("killed between two parts of one chunk")
        return commit(*args, **kwargs)

    monkeypatch.setattr(first.guard, "commit", dies_on_the_third)
    with pytest.raises(RuntimeError, match="killed"):
        list(first.run(iter([rows])))
    first.close(False)
    assert calls == [0, 1, 2], "each part is a chunk of its own"
    assert not sink.visible
    retry = _attempt(spec, guards, 2)
    list(retry.run(iter([rows])))
    retry.close(True)
    assert _seen(sink) == list(range(10)), "each record once: replayed or run, never both"
    assert retry.counters["events/replayed_inputs"] == 4
    backup = _backup(redis_server, spec)
    assert len(_chunk_fields(backup)) == 5
    assert max(len(backup[f]) for f in _chunk_fields(backup)) <= BUDGET


def test_one_record_whose_outputs_pass_a_commit_is_one_dead_letter(redis_server):
    """A flat_map that makes ten outputs of 10 KB from record 3 (100 KB together): record 3
    is a dead letter saying why, committed so that a later attempt replays it."""
    sink, dead = Recorder(), Recorder()

    def explode(e):
        return [{**e, "part": k, "pad": "p" * 10 * KB} for k in range(10)] if e["i"] == 3 else [e]

    spec, guards = _stage(redis_server, lambda s: s.flat_map("explode", explode), sink, dead)
    rows = _raw_rows(_values(6, 10))
    task = _attempt(spec, guards, 1)
    list(task.run(iter([rows])))
    task.close(True)
    assert _seen(sink) == [0, 1, 2, 4, 5]
    [(_id, letter)] = dead.visible
    assert letter["code"] == "too_large" and "DedupConfig.chunk_bytes" in letter["error"]
    assert task.counters["events/too_large"] == 1
    again = _attempt(spec, guards, 2)  # the task is done: nothing new, no second letter
    list(again.run(iter([rows])))
    again.close(True)
    assert _seen(sink) == [0, 1, 2, 4, 5] and len(dead.visible) == 1


def test_an_input_over_max_record_bytes_is_a_dead_letter_that_stays_small(redis_server):
    sink, dead = Recorder(), Recorder()
    spec, guards = _stage(
        redis_server, lambda s: s.map("same", lambda e: e), sink, dead, max_record_bytes=50 * KB
    )
    values = _values(4, 10)
    values[2] = json.dumps({"i": 2, "body": "b" * 60 * KB}).encode()
    task = _attempt(spec, guards, 1)
    list(task.run(iter([_raw_rows(values)])))
    task.close(True)
    assert _seen(sink) == [0, 1, 3]
    [(_id, letter)] = dead.visible
    assert letter["code"] == "too_large" and "max_record_bytes" in letter["error"]
    assert letter["origin"] == "in:0@2" and len(json.dumps(letter)) < 2000


def test_held_deliveries_are_cut_by_bytes(redis_server):
    """Ten records of 20 KB and deliveries of 64 KiB: four transactions of at most three."""
    sink = Counted()
    spec, guards = _stage(
        redis_server, lambda s: s.map("same", lambda e: e), sink, Recorder(), delivery_bytes=BUDGET
    )
    task = _attempt(spec, guards, 1)
    list(task.run(iter([_raw_rows(_values(10, 20 * KB))])))
    task.close(True)
    assert _seen(sink) == list(range(10))
    assert sink.commits == 4


def test_end_of_task_outputs_over_a_chunk_go_in_parts_and_a_retry_sends_each_once(
    redis_server, monkeypatch
):
    """The end-of-task outputs (combine results, panes) of a task that died after the first
    of their parts: the retry replays that part and commits and sends the rest only."""
    spec, guards = _stage(
        redis_server, lambda s: s.map("same", lambda e: e), Recorder(), Recorder()
    )
    outs = [Output(0, bytes([i]) * 16, TS, None, b"v" * 20 * KB) for i in range(10)]
    first = _attempt(spec, guards, 1)
    first.guard.open()

    def killed(*args: Any) -> None:
        raise RuntimeError("killed before the last part")

    monkeypatch.setattr(first.guard, "finish", killed)
    with pytest.raises(RuntimeError, match="killed"):
        first.finish(0, outs, {}, set())
    first.close(False)
    retry = _attempt(spec, guards, 2)
    replay = retry.guard.open()
    assert 0 < len(replay.outputs) < len(outs) and not replay.done
    rest = retry.finish(replay.next_chunk, outs, {}, {o.id for o in replay.outputs})
    assert sorted(o.id for o in replay.outputs + rest) == sorted(o.id for o in outs)
    backup = _backup(redis_server, spec)
    assert b"done" in backup and max(len(v) for v in backup.values()) <= BUDGET


def test_rows_go_back_to_spark_in_arrow_batches_of_a_chunks_bytes(redis_server):
    spec, guards = _stage(
        redis_server, lambda s: s.map("same", lambda e: e), Recorder(), Recorder()
    )
    task = _attempt(spec, guards, 1)
    outs = [Output(0, bytes([i]) * 16, TS, None, b"v" * 20 * KB) for i in range(10)]
    batches = list(task.arrow_batches(outs))
    assert [b.num_rows for b in batches] == [3, 3, 3, 1]
    assert outputs_bytes(outs[:3]) <= BUDGET < outputs_bytes(outs[:4])


def test_a_source_hands_on_its_records_in_slices_of_a_chunks_bytes():
    items = [{"i": i, "body": "b" * 500 * KB} for i in range(20)]
    p = Pipeline("slices-by-bytes")
    p.read("items", sources.Collection(items)).write("out", sinks.Collect())
    spec = p.job().stages[0]
    task = TaskRun(spec, no_guard, TaskRef(spec.name, 0, 0))
    one_split = pa.RecordBatch.from_pydict({"split": [0], "splits": [1]})
    slices = list(task.input.source_rows(iter([one_split])))
    assert [r[4]["i"] for s in slices for r in s.rows] == list(range(20))
    largest = max(s.sizes[0] for s in slices)
    assert len(slices) > 1
    assert all(sum(s.sizes) < task.guard.chunk_bytes + largest for s in slices)
    assert Budget(0, task.guard.chunk_bytes).fits(1, largest)


def test_records_gc_made_late_while_the_batch_ran_are_dead_letters_not_admitted(redis_server):
    """GC raised its floor past some of a part's records after the batch fixed its params
    (the commit check of ``tests/exactly_once/test_gc.py``): the task commits the rest and
    turns those into late dead letters, whatever budget splits the chunk."""
    from onceflow.kernel.keyspace import GC_FLOOR_FIELD

    sink, dead = Recorder(), Recorder()
    name = f"gc-late-{uuid.uuid4().hex[:8]}"
    dedup = DedupConfig(chunk_bytes=BUDGET, bucket_ms=1)
    p = Pipeline(name, dead_letters=dead, max_record_bytes=BUDGET, dedup=dedup)
    source = KafkaSource("in", bootstrap_servers="127.0.0.1:1", id=lambda e: f"e{e['i']}")
    p.read("events", source).map("same", lambda e: e).write("out", sink)
    spec = p.job().stages[0].with_dead_letters(dead)
    client = redis_server.client()
    client.incr(Keyspace(name).epoch)
    params = BatchParams(0, TS, TS, TS, 24 * 3_600_000, 0, 0, (0,), TS * 2)
    guards = ExactlyOnceGuards(RedisSettings(redis_server.url), name, 1, p.dedup)
    client.hset(Keyspace(name).gc, GC_FLOOR_FIELD, TS + 6)  # GC ran after the params
    task = _attempt(spec, guards.for_batch(params), 1)
    list(task.run(iter([_raw_rows(_values(10, 20 * KB))])))  # event times TS .. TS + 9
    task.close(True)
    assert _seen(sink) == [6, 7, 8, 9], "records GC's floor made late were admitted"
    letters = [str(d) for d in dead.visible]
    assert len(letters) == 6 and all("older than the dedup horizon" in t for t in letters)
    assert task.counters[f"{spec.name}/late"] == 6
