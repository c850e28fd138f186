"""Optimized and unoptimized plans give the same outputs on Spark, and match a reference."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onceflow.graph_optimizer.ir import Sink
from onceflow.pipeline import Pipeline, sinks, sources
from tests.graph_optimizer import helpers as h
from tests.graph_optimizer.reference import evaluate, multiset

pytestmark = pytest.mark.spark


def run_collect(pipeline, spark, tmp_path, rules):
    pipeline.run(session=spark, progress=False, rules=rules, output_dir=str(tmp_path))
    out = {}
    for node in pipeline.graph:
        if isinstance(node, Sink):
            out[node.name] = multiset(node.connector.results)
    return out


@pytest.mark.parametrize(
    "build",
    [
        h.chain,
        h.keyed_sum,
        h.group_lists,
        h.fan_out,
        h.merge_same_stage,
        h.merge_two_sources,
        h.two_combines,
        h.dead_branch,
        h.chain_after_combine,
    ],
    ids=lambda f: f.__name__,
)
def test_fused_and_unfused_plans_agree_with_the_reference(build, spark, tmp_path):
    pipeline = build()
    expected = {k: multiset(v) for k, v in evaluate(pipeline.graph).items()}
    fused = run_collect(pipeline, spark, tmp_path, rules=None)
    unfused = run_collect(pipeline, spark, tmp_path, rules=())
    assert fused == expected
    assert unfused == expected


# -- random pipelines ---------------------------------------------------------------------------

ops = st.one_of(
    st.tuples(st.just("map"), st.integers(-3, 3), st.integers(-5, 5)),
    st.tuples(st.just("filter"), st.integers(2, 4), st.integers(0, 1)),
    st.tuples(st.just("flat"), st.integers(1, 3)),
    st.tuples(st.just("key"), st.integers(1, 4)),
    st.tuples(st.just("combine"), st.sampled_from(["sum", "count", "min", "max"])),
    st.tuples(st.just("group")),
    st.tuples(st.just("unkey")),
    st.tuples(st.just("fanout")),
    st.tuples(st.just("merge"), st.integers(1, 3)),
)


def build_random(data, steps):
    p = Pipeline("random")
    s = p.read("src", sources.Collection(data))
    sink_n = 0
    for i, op in enumerate(steps):
        name = f"s{i}"
        kind = op[0]
        if kind == "map":
            a, b = op[1], op[2]
            s = (
                s.map_values(name, lambda v, a=a, b=b: a * v + b)
                if s.keyed
                else s.map(name, lambda x, a=a, b=b: a * x + b)
            )
        elif kind == "filter":
            m, r = op[1], op[2]
            s = s.filter(
                name,
                (lambda kv, m=m, r=r: kv[1] % m != r)
                if s.keyed
                else (lambda x, m=m, r=r: x % m != r),
            )
        elif kind == "flat":
            n = op[1]
            if s.keyed:
                s = s.map(name, lambda kv: kv[0] * 100 + kv[1])
            else:
                s = s.flat_map(name, lambda x, n=n: [x + j for j in range(abs(x) % (n + 1))])
        elif kind == "key":
            m = op[1]
            if s.keyed:
                s = s.map(name + "u", lambda kv: kv[1])
            s = s.key_by(name, lambda x, m=m: x % m)
        elif kind in ("combine", "group"):
            if not s.keyed:
                s = s.key_by(name + "k", lambda x: x % 3)
            if kind == "combine":
                s = s.combine_per_key(name, op[1])
            else:
                s = s.group_by_key(name).map_values(name + "v", lambda vs: sum(vs) * 10 + len(vs))
        elif kind == "unkey" and s.keyed:
            s = s.map(name, lambda kv: kv[0] * 1000 + kv[1])
        elif kind == "fanout":
            s.write(f"{name}-out", sinks.Collect())
            sink_n += 1
        elif kind == "merge":
            a = op[1]
            other = (
                s.map_values(name + "o", lambda v, a=a: v * a)
                if s.keyed
                else s.map(name + "o", lambda x, a=a: x * a)
            )
            s = p.merge(name, s, other)
    s.write("final", sinks.Collect())
    return p


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    data=st.lists(st.integers(-20, 20), max_size=30), steps=st.lists(ops, min_size=1, max_size=6)
)
def test_random_pipelines_give_the_same_multiset_fused_and_unfused(
    spark, tmp_path_factory, data, steps
):
    pipeline = build_random(data, steps)
    tmp = tmp_path_factory.mktemp("random")
    expected = {k: multiset(v) for k, v in evaluate(pipeline.graph).items()}
    assert run_collect(pipeline, spark, tmp, rules=None) == expected
    assert run_collect(pipeline, spark, tmp, rules=()) == expected
