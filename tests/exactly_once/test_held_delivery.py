"""A task holds its sink records and delivers them together: at the end of the task, or once
``DedupConfig.delivery_records`` of a sink are held (or ``delivery_bytes``, see
tests/runtime/test_byte_budgets.py). Held records are backed up already, so an attempt
that dies holding them loses nothing: the retry replays them from the backup and delivers
each once. Sinks are in-memory recorders of what became visible; dedup runs on a real Redis.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from onceflow.kernel import codec
from onceflow.kernel.records import Output, TaskRef
from onceflow.runtime.task.loop import TaskRun
from tests.dedup.test_guard import _rows
from tests.exactly_once.test_refused_records import Recorder, Transactional, _stage

pytestmark = pytest.mark.redis


class Counted(Transactional):
    """A transactional recorder that counts the transactions it committed."""

    def __init__(self) -> None:
        super().__init__(too_big=-1, poison=-1)
        self.commits = 0

    def open(self, task):
        writer = super().open(task)
        commit = writer.commit

        def counted() -> None:
            self.commits += 1
            commit()

        writer.commit = counted
        return writer


def _commit_chunks(task: TaskRun, chunks: list[list], start: int = 0) -> list[Output]:
    """Commit each chunk of rows as the stage's outputs, handing them over as the loop does."""
    everything: list[Output] = []
    for n, rows in enumerate(chunks, start):
        outs = [Output(0, rid, ts, None, codec.encode(elem)) for _p, rid, ts, _k, elem in rows]
        assert task.guard.commit(n, rows, outs, {}, {}) == set()
        assert list(task.emit(outs)) == []  # sink records only: nothing goes back to Spark
        everything += outs
    return everything


def _values(sink) -> list[int]:
    return sorted(e["i"] if isinstance(e, dict) else json.loads(e)["i"] for _id, e in sink.visible)


def test_an_attempt_that_dies_holding_committed_records_loses_none_and_doubles_none(
    redis_server,
):
    sink = Counted()
    spec, guards = _stage(redis_server, sink, Recorder())
    rows = _rows(9, 21)
    first = TaskRun(spec, guards, TaskRef(spec.name, 0, 0, 0, spec.sinks, 1))
    first.guard.open()
    _commit_chunks(first, [rows[:3], rows[3:6], rows[6:]])
    assert sink.visible == [], "held until the end of the task"
    first.close(False)  # dies before its end: the three chunks are committed, none delivered
    retry = TaskRun(spec, guards, TaskRef(spec.name, 0, 0, 1, spec.sinks, 2))
    list(retry.run(iter([])))  # replays the backup, ends the task
    retry.close(True)
    assert _values(sink) == list(range(9))
    assert len({rid for rid, _e in sink.visible}) == 9
    assert sink.commits == 1, "one transaction for the whole task"
    again = TaskRun(spec, guards, TaskRef(spec.name, 0, 0, 2, spec.sinks, 3))
    list(again.run(iter([])))  # a third attempt (the task was done): delivers nothing new
    again.close(True)
    assert _values(sink) == list(range(9))


def test_a_sink_with_delivery_records_held_is_delivered_before_the_end(redis_server):
    sink = Counted()
    spec, guards = _stage(redis_server, sink, Recorder())
    guards = replace(guards, config=replace(guards.config, delivery_records=4))
    rows = _rows(9, 22)
    task = TaskRun(spec, guards, TaskRef(spec.name, 0, 0, 0, spec.sinks, 1))
    task.guard.open()
    _commit_chunks(task, [rows[:3], rows[3:6]])
    assert _values(sink) == list(range(6)), "six held (four or more): delivered at once"
    assert sink.commits == 2, "in deliveries of at most four records"
    _commit_chunks(task, [rows[6:]], start=2)
    assert sink.commits == 2, "three held: not yet"
    list(task.release())
    task.close(True)
    assert _values(sink) == list(range(9))
    assert sink.commits == 3
