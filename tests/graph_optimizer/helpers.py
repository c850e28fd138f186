"""Small pipelines shared by the optimizer tests."""

from __future__ import annotations

from onceflow.pipeline import Pipeline, sinks, sources
from onceflow.pipeline.combiners import ToList


def stages(plan):
    """Stages as tuples of node names, in plan order: the golden form of a plan."""
    return [s.nodes for s in plan.ordered]


def chain():
    p = Pipeline("chain")
    (
        p.read("src", sources.Collection(range(10)))
        .map("a", lambda x: x + 1)
        .filter("b", lambda x: x % 2 == 0)
        .write("out", sinks.Collect())
    )
    return p


def keyed_sum(combiner="sum"):
    p = Pipeline("keyed")
    (
        p.read("src", sources.Collection(range(20)))
        .key_by("k", lambda x: x % 3)
        .combine_per_key("agg", combiner)
        .write("out", sinks.Collect())
    )
    return p


def group_lists():
    return keyed_sum(ToList())


def fan_out():
    p = Pipeline("fan")
    src = p.read("src", sources.Collection(range(10)))
    src.map("a", lambda x: x * 2).write("out-a", sinks.Collect())
    src.map("b", lambda x: x * 3).write("out-b", sinks.Collect())
    return p


def merge_same_stage():
    p = Pipeline("merge1")
    src = p.read("src", sources.Collection(range(10)))
    a = src.map("a", lambda x: x * 2)
    b = src.map("b", lambda x: x * 3)
    p.merge("m", a, b).write("out", sinks.Collect())
    return p


def merge_two_sources():
    p = Pipeline("merge2")
    a = p.read("s1", sources.Collection(range(5)))
    b = p.read("s2", sources.Collection(range(5, 10)))
    p.merge("m", a, b).map("after", lambda x: x + 1).write("out", sinks.Collect())
    return p


def two_combines():
    p = Pipeline("two")
    keyed = p.read("src", sources.Collection(range(30))).key_by("k", lambda x: x % 4)
    keyed.combine_per_key("sum", "sum").write("out-sum", sinks.Collect())
    keyed.combine_per_key("count", "count").write("out-count", sinks.Collect())
    return p


def dead_branch():
    p = Pipeline("dead")
    src = p.read("src", sources.Collection(range(10)))
    src.map("live", lambda x: x).write("out", sinks.Collect())
    src.map("dead1", lambda x: x).filter("dead2", bool)
    return p


def chain_after_combine():
    p = Pipeline("after")
    (
        p.read("src", sources.Collection(range(20)))
        .key_by("k", lambda x: x % 5)
        .combine_per_key("agg", "max")
        .map("fmt", lambda kv: f"{kv[0]}={kv[1]}")
        .write("out", sinks.Collect())
    )
    return p
