"""Drop nodes whose output reaches no sink.

Runs first: later rules then never fuse work that nobody reads. Skipping it costs only speed
(a dead element-wise branch inside a fused stage still runs for nothing).

Example, a branch nobody writes (``unread``):

>>> from onceflow import Pipeline, sinks, sources
>>> p = Pipeline("example")
>>> src = p.read("src", sources.Collection([1, 2, 3]))
>>> src.map("live", str).write("out", sinks.Collect())
>>> _ = src.map("unread", str)
>>> plan = p.plan(rules=())
>>> [s.nodes for s in plan.ordered]
[('src',), ('live',), ('out',), ('unread',)]
>>> after = remove_dead_branches(plan)
>>> [s.nodes for s in after.ordered], after.removed
([('src',), ('live',), ('out',)], ('unread',))
"""

from __future__ import annotations

from dataclasses import replace

from onceflow.graph_optimizer.plan import Plan, Stage


def remove_dead_branches(plan: Plan) -> Plan:
    """Return ``plan`` without the nodes that feed no sink (listed in ``plan.removed``)."""
    graph = plan.graph
    live: set[str] = set()
    frontier = [s.name for s in graph.sinks()]
    while frontier:
        name = frontier.pop()
        if name in live:
            continue
        live.add(name)
        frontier.extend(graph[name].inputs)
    dead = [n.name for n in graph if n.name not in live]
    if not dead:
        return plan
    new_graph = graph.replace_nodes(n for n in graph if n.name in live)
    stages = []
    for s in plan.stages:
        kept = tuple(n for n in s.nodes if n in live)
        if kept:
            stages.append(Stage(kept, s.label))
    return replace(plan, graph=new_graph, stages=tuple(stages), removed=(*plan.removed, *dead))
