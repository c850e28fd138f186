"""Producer-consumer fusion: run an element-wise consumer in its producer's pass.

A stage is fused into the stage it reads when every edge entering it is a direct edge from
that one stage. It is never fused across an exchange (the data must be repartitioned first),
nor when it reads several stages (a merge of streams computed in different passes). Runs
after combiner lifting so that partial combines join their producers. Skipping it costs only
speed: each unfused edge is an extra Python pass and, with exactly-once on, an extra backup
and dedup boundary.

Example, a word count (fused up to the exchange before ``n``, and after it):

>>> from onceflow import Pipeline, sinks, sources
>>> p = Pipeline("example")
>>> words = p.read("src", sources.Collection(["a b", "b"])).flat_map("split", str.split)
>>> words.key_by("k", str).combine_per_key("n", "count").write("out", sinks.Collect())
>>> plan = p.plan(rules=())
>>> [s.nodes for s in plan.ordered]
[('src',), ('split',), ('k',), ('n',), ('out',)]
>>> [s.nodes for s in fuse_producer_consumer(plan).ordered]
[('src', 'split', 'k'), ('n', 'out')]
"""

from __future__ import annotations

from onceflow.graph_optimizer.plan import Plan, Via, merge_stages


def fuse_producer_consumer(plan: Plan) -> Plan:
    """Return ``plan`` with every fusable consumer stage merged into its producer."""
    result = plan
    while True:
        pair = _first_fusable(result)
        if pair is None:
            return result
        result = merge_stages(result, pair)


def _first_fusable(plan: Plan) -> tuple[str, str] | None:
    for stage in plan.ordered:
        if plan.is_source_stage(stage):
            continue
        edges = plan.inbound(stage)
        if not edges or any(e.via is not Via.DIRECT for e in edges):
            continue
        producers = plan.producer_stages(stage)
        if len(producers) == 1:
            return (producers[0], stage.name)
    return None
