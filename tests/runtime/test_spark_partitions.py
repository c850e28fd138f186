"""A task's partition is its stage's own, wherever Spark runs it (unions shift partition ids).

Keyed state and timers of an exchange stage are kept per partition, and the driver looks for
timers in partitions ``0 .. parallelism - 1``; a source stage read by a consumer and by the
action (driver-bound rows) must run once per batch, or its second run conflicts with the
first and drops its records as copies.
"""

from __future__ import annotations

from collections import Counter

import pytest

from onceflow.pipeline import Pipeline, sinks, sources
from onceflow.runtime.driver.compile import compile_batch
from onceflow.runtime.guard import NoGuard
from onceflow.runtime.metrics import CounterParam

pytestmark = pytest.mark.spark


class RecordingGuard(NoGuard):
    """Counts each task it guarded as ``task|<stage>|<partition>``."""

    def __init__(self, stage, partition):
        self.key = f"task|{stage}|{partition}"

    def close(self):
        return {self.key: 1}


def recording_guards(task):
    return RecordingGuard(task.stage, task.partition)


def two_terminal_stages():
    """A source stage with a driver-bound sink and a consumer; two exchange stages."""
    p = Pipeline("partitions")
    events = p.read("events", sources.Collection(list(range(40))))
    events.write("raw", sinks.Collect())
    keyed = events.key_by("by-mod", lambda x: x % 5)
    keyed.combine_per_key("total", "sum").write("totals", sinks.Collect())
    keyed.map_values("double", lambda v: 2 * v).combine_per_key("max", "max").write(
        "maxima", sinks.Collect()
    )
    return p.job(rules=())


@pytest.mark.parametrize("splits", [1, 3])
def test_exchange_stages_keep_their_own_partitions_and_sources_run_once(spark, splits):
    job = two_terminal_stages()
    [source_name] = [name for name, _ in job.sources]
    source = spark.range(0, splits, 1, splits).selectExpr("id", f"{splits} as splits")
    metrics = spark.sparkContext.accumulator({}, CounterParam())
    compiled = compile_batch(
        job,
        spark,
        {source_name: source},
        recording_guards,
        batch=0,
        parallelism=2,
        metrics=metrics,
    )
    compiled.run()
    tasks = Counter()
    for key, n in metrics.value.items():  # counters are named "<stage>/<name>"
        if "/task|" in key:
            stage, partition = key.split("/task|")[1].split("|")
            tasks[(stage, int(partition))] += n
    exchange = {s.name for s in job.stages if s.exchange}
    for name in exchange:
        assert {p for (s, p) in tasks if s == name} == {0, 1}, tasks
    assert sum(n for (s, _), n in tasks.items() if s == "events") == splits, tasks
    sinks_by_name = {t.name: t.connector for s in job.stages for t in s.targets}
    assert sorted(sinks_by_name["raw"].results) == list(range(40))
    assert sorted(sinks_by_name["totals"].results) == [
        (k, sum(x for x in range(40) if x % 5 == k)) for k in range(5)
    ]


def two_exchanges_into_one_stage():
    """Two keyed branches of one stream (a combine and a process, keyed apart): the optimizer
    fuses them into one stage that reads the source stage through two exchanges."""
    from onceflow.state import ValueSpec

    seen = ValueSpec("seen")

    def count(key, value, ctx):
        state = ctx.state(seen)
        state.write((state.read() or 0) + 1)
        return [(key, value, state.read())]

    p = Pipeline("fan-in")
    events = p.read("events", sources.Collection(list(range(40))))
    events.key_by("by-mod", lambda x: x % 5).combine_per_key("total", "sum").write(
        "totals", sinks.Collect()
    )
    events.key_by("by-odd", lambda x: x % 2).process("count", count, states=[seen]).write(
        "counted", sinks.Collect()
    )
    return p.job()


def test_a_stage_reading_two_exchanges_of_one_stage_runs_that_stage_once(spark):
    """Found by the torture run's process stage (``tests/exactly_once/torture.py``): its
    branch, fused with the totals' combine, got no record: the source stage ran once per
    exchange, and its second run dropped every record as a copy of the first's."""
    job = two_exchanges_into_one_stage()
    [consumer] = [s for s in job.stages if s.source is None]
    assert len(consumer.inbound) == 2 and consumer.producers == ("events",), job.layout
    [source_name] = [name for name, _ in job.sources]
    source = spark.range(0, 2, 1, 2).selectExpr("id", "2 as splits")
    metrics = spark.sparkContext.accumulator({}, CounterParam())
    compile_batch(
        job, spark, {source_name: source}, recording_guards, batch=0, parallelism=2, metrics=metrics
    ).run()
    runs = sum(n for key, n in metrics.value.items() if "/task|events|" in key)
    assert runs == 2, f"the source stage's tasks ran {runs} times for 2 splits"
    sinks_by_name = {t.name: t.connector for s in job.stages for t in s.targets}
    assert sorted(sinks_by_name["totals"].results) == [
        (k, sum(x for x in range(40) if x % 5 == k)) for k in range(5)
    ]
    counted = sinks_by_name["counted"].results
    assert sorted(x for _, x, _ in counted) == list(range(40))
    for parity in (0, 1):
        assert sorted(n for k, _, n in counted if k == parity) == list(range(1, 21))
