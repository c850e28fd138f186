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


# -- a stage's identity does not depend on who reads it (issue 37, R1) ---------------------


def _orders_and_payments(p):
    orders = p.read("orders", sources.Collection([(i % 4, i) for i in range(24)]))
    payments = p.read("payments", sources.Collection([(i % 4, -i) for i in range(24)]))
    return orders, payments


def _keyed(orders, payments):
    return (
        orders.key_by("order-key", lambda x: x[0]),
        payments.key_by("payment-key", lambda x: x[0]),
    )


def shape_join(p):
    """The review's example: ``orders -> count`` and ``payments.join(orders)``."""
    orders, payments = _keyed(*_orders_and_payments(p))
    orders.count_per_key("count").write("counts", sinks.Collect())
    payments.join("joined", orders, 10).write("pairs", sinks.Collect())


def shape_co_group(p):
    orders, payments = _keyed(*_orders_and_payments(p))
    orders.count_per_key("count").write("counts", sinks.Collect())
    payments.co_group("grouped", orders, 10).write("groups", sinks.Collect())


def shape_interval_join(p):
    orders, payments = _keyed(*_orders_and_payments(p))
    orders.count_per_key("count").write("counts", sinks.Collect())
    payments.interval_join("near", orders, -5, 5).write("pairs", sinks.Collect())


def shape_join_table(p):
    orders, payments = _keyed(*_orders_and_payments(p))
    orders.count_per_key("count").write("counts", sinks.Collect())
    payments.join_table("enriched", orders).write("rows", sinks.Collect())


def shape_merge_keyed_and_unkeyed(p):
    """``orders`` read by a keyed consumer (an exchange) and an unkeyed one (a merge)."""
    orders, payments = _orders_and_payments(p)
    orders.key_by("order-key", lambda x: x[0]).count_per_key("count").write(
        "counts", sinks.Collect()
    )
    p.merge("all", payments, orders).map("amount", lambda x: x[1]).write("all-out", sinks.Collect())


def shape_two_sinks(p):
    """Two sink branches of ``orders``, unfused (each its own stage), beside a merge."""
    orders, payments = _orders_and_payments(p)
    orders.map("first", lambda x: x[1]).write("first-out", sinks.Collect())
    orders.map("second", lambda x: -x[1]).write("second-out", sinks.Collect())
    p.merge("all", payments, orders).write("all-out", sinks.Collect())


SHAPES = {
    "join": (shape_join, None),
    "co_group": (shape_co_group, None),
    "interval_join": (shape_interval_join, None),
    "join_table": (shape_join_table, None),
    "merge, keyed and unkeyed readers": (shape_merge_keyed_and_unkeyed, None),
    "two sinks, unfused": (shape_two_sinks, ()),
}


def _partitions_run(spark, job, splits, reader):
    """``{stage: partitions its tasks ran under}`` when Spark computes ``reader`` alone.

    ``reader``: a stage name (its frame, with everything it reads) or None (the batch's
    action). Each call compiles the batch afresh: nothing is cached from an earlier run.
    """
    frames = {
        name: spark.range(0, splits, 1, splits).selectExpr("id", f"{splits} as splits")
        for name, _ in job.sources
    }
    metrics = spark.sparkContext.accumulator({}, CounterParam())
    compiled = compile_batch(
        job, spark, frames, recording_guards, batch=0, parallelism=2, metrics=metrics
    )
    try:
        if reader is None:
            compiled.run()
        else:
            compiled.frames[reader].collect()
    finally:
        for frame in compiled.persisted:
            frame.unpersist()
    seen: dict[str, set[int]] = {}
    for key in metrics.value:  # counters are named "<stage>/task|<stage>|<partition>"
        if "/task|" in key:
            stage, partition = key.split("/task|")[1].split("|")
            seen.setdefault(stage, set()).add(int(partition))
    return seen


def test_the_review_example_runs_orders_under_its_own_partitions_for_both_readers(spark):
    """``orders`` run for ``count`` alone and for the join alone: the same partitions."""
    p = Pipeline("review-example")
    shape_join(p)
    job = p.job()
    readers = [s.name for s in job.stages if "orders" in s.producers]
    assert len(readers) == 2, job.layout
    ran = {r: _partitions_run(spark, job, 2, r)["orders"] for r in readers}
    assert all(parts == {0, 1} for parts in ran.values()), ran


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_stage_runs_under_its_own_partitions_whoever_reads_it(spark, shape):
    """Every stage, computed for each of its readers alone and for the whole batch, runs under
    the partitions it runs under when its own frame is computed alone."""
    build, rules = SHAPES[shape]
    p = Pipeline(f"identity-{shape.split(',')[0].replace(' ', '-').replace('_', '-')}")
    build(p)
    job = p.job(rules=rules)
    assert any(len(job.consumers(s.name)) > 1 for s in job.stages), job.layout
    own = {}
    for spec in job.stages:
        own[spec.name] = _partitions_run(spark, job, 3, spec.name)[spec.name]
        assert own[spec.name] == set(range(len(own[spec.name]))), (spec.name, own)
    runs = {None: _partitions_run(spark, job, 3, None)}
    for spec in job.stages:
        for reader in job.consumers(spec.name):
            runs[reader] = _partitions_run(spark, job, 3, reader)
    wrong = {
        (reader, stage): (parts, own[stage])
        for reader, seen in runs.items()
        for stage, parts in seen.items()
        if parts != own[stage]
    }
    assert not wrong, f"(reader, stage): (partitions, its own): {wrong}"
