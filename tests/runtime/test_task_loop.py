"""The task loop without Spark: how a source's decoded records reach the chunks."""

from __future__ import annotations

import pyarrow as pa

from onceflow import Pipeline, sinks, sources
from onceflow.connectors.errors import ConnectorError
from onceflow.kernel.limits import SOURCE_SLICE_RECORDS as SOURCE_SLICE
from onceflow.kernel.records import TaskRef
from onceflow.runtime.guard import no_guard
from onceflow.runtime.task import times as task_times
from onceflow.runtime.task.loop import StageFunction, TaskRun


def test_a_batch_standing_for_many_records_is_handed_on_in_slices():
    """A Kafka source's batch may be one offset range its task reads: the records of one
    batch must reach the chunks a slice at a time, not all decoded first."""
    total = 2 * SOURCE_SLICE + 123
    p = Pipeline("slices")
    p.read("gen", sources.Generate(total, splits=1)).write("out", sinks.Collect())
    spec = p.job().stages[0]
    task = TaskRun(spec, no_guard, TaskRef(spec.name, 0, 0))
    one_split = pa.RecordBatch.from_pydict({"split": [0], "splits": [1]})
    slices = list(task.input.source_rows(iter([one_split])))
    assert [len(s.rows) for s in slices] == [SOURCE_SLICE, SOURCE_SLICE, 123]
    assert [r[4] for s in slices for r in s.rows] == list(range(total))
    assert all(len(s.lanes) == len(s.rows) == len(s.positional) for s in slices)


def test_a_failure_names_the_record_only_when_it_is_not_a_connectors_failure():
    """An error met while the task handled a record names that record; a source or sink
    that fails (a broker gone mid-range) is no record's fault."""
    p = Pipeline("failing")
    p.read("gen", sources.Generate(6, splits=1)).write("out", sinks.Collect())
    spec = p.job().stages[0]
    task = TaskRun(spec, no_guard, TaskRef(spec.name, 0, 0))
    task.origins.add(b"p" * 16, "t:0", 41)
    task.body.cursor.parent = b"p" * 16
    line = task.failure_line(ValueError("bad value"))
    assert "ValueError: bad value" in line and line.endswith("[input record t:0@41]")
    broker = task.failure_line(ConnectorError("reading t:0 at offset 42: broker down"))
    assert broker.endswith("broker down")


class _Counters:
    """What the run's accumulator gets from a task (``metrics.add``)."""

    def __init__(self) -> None:
        self.value: dict[str, int] = {}

    def add(self, counters: dict[str, int]) -> None:
        for k, v in counters.items():
            self.value[k] = self.value.get(k, 0) + v


def _run_task(monkeypatch, times: str | None) -> dict[str, int]:
    if times is None:
        monkeypatch.delenv(task_times.ENV, raising=False)
    else:
        monkeypatch.setenv(task_times.ENV, times)
    p = Pipeline("timed")
    p.read("gen", sources.Generate(50, splits=1)).write("out", sinks.Collect())
    spec = p.job().stages[0]
    counters = _Counters()
    fn = StageFunction(spec, no_guard, 0, counters)
    list(fn(iter([pa.RecordBatch.from_pydict({"split": [0], "splits": [1]})])))
    return counters.value


def test_task_steps_are_timed_only_when_asked(monkeypatch):
    """``bench/latency.py --phases`` reads where a task's time went from its counters."""
    timed = _run_task(monkeypatch, "1")
    assert timed["gen/tasks"] == 1
    assert {"gen/time_us/task", "gen/time_us/input", "gen/time_us/stage code"} <= set(timed)
    assert timed["gen/time_us/task"] >= timed["gen/time_us/input"]
    assert timed["gen/in"] == 50
    plain = _run_task(monkeypatch, None)
    assert not [k for k in plain if "time_us" in k or k.endswith("/tasks")]
    assert plain["gen/in"] == 50
