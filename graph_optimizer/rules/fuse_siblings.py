"""Sibling fusion: stages that read the same producer in the same way share one pass.

Two stages that both read only stage ``S`` directly are fused, so ``S``'s output is read once.
Two stages that both read only ``S`` through exchanges are fused too: ``S``'s records for both
are then repartitioned in a single shuffle (for example two combines over one keyed stream).
Stages are never fused when one reads the other, when they mix direct and exchange inputs,
or when either is a source stage. Runs after producer-consumer fusion, which already absorbs
direct consumers when it may; skipping it costs only speed.

The fused stage is named after what its members share, the producer and how they read it
(``<producer>/shuffled``, ``<producer>/direct``), never after one member: a stage's name keys
its dedup history, backups and counters, so renaming one step (or adding one before it) would
otherwise start every sibling's dedup history over (issue 42).

Example, two combines over one keyed stream, after producer-consumer fusion:

>>> from onceflow import Pipeline, sinks, sources
>>> from onceflow.graph_optimizer.rules import fuse_producer_consumer
>>> p = Pipeline("example")
>>> keyed = p.read("src", sources.Collection([1, 2, 3])).key_by("k", str)
>>> keyed.combine_per_key("n", "count").write("counts", sinks.Collect())
>>> keyed.combine_per_key("total", "sum").write("sums", sinks.Collect())
>>> plan = fuse_producer_consumer(p.plan(rules=()))
>>> [(s.name, s.nodes) for s in plan.ordered]
[('src', ('src', 'k')), ('n', ('n', 'counts')), ('total', ('total', 'sums'))]
>>> [(s.name, s.nodes) for s in fuse_siblings(plan).ordered]
[('src', ('src', 'k')), ('src/shuffled', ('n', 'counts', 'total', 'sums'))]
"""

from __future__ import annotations

from onceflow.graph_optimizer.plan import Plan, Stage, Via, merge_stages


def fuse_siblings(plan: Plan) -> Plan:
    """Return ``plan`` with sibling stages merged."""
    result = plan
    while True:
        found = _first_sibling_group(result)
        if found is None:
            return result
        (producer, via), group = found
        result = merge_stages(result, group, sibling_label(producer, via))


def sibling_label(producer: str, via: Via) -> str:
    """The name of the stage the siblings reading ``producer`` by ``via`` share."""
    return f"{producer}/{'shuffled' if via is Via.EXCHANGE else 'direct'}"


def _signature(plan: Plan, stage: Stage) -> tuple[str, Via] | None:
    if plan.is_source_stage(stage):
        return None
    edges = plan.inbound(stage)
    vias = {e.via for e in edges}
    producers = plan.producer_stages(stage)
    if len(vias) != 1 or len(producers) != 1:
        return None
    return (producers[0], vias.pop())


def _first_sibling_group(plan: Plan) -> tuple[tuple[str, Via], list[str]] | None:
    groups: dict[tuple[str, Via], list[str]] = {}
    for stage in plan.ordered:
        sig = _signature(plan, stage)
        if sig is not None:
            groups.setdefault(sig, []).append(stage.name)
    for sig, names in groups.items():
        if len(names) > 1:
            return sig, names
    return None
