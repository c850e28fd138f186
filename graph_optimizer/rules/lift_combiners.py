"""Combiner lifting: fold values per key before the exchange, not only after it.

``Exchange -> Combine(full)`` becomes ``Combine(partial) -> Exchange -> Combine(final)``: the
partial combine folds each partition's values into one accumulator per key, so the shuffle
carries one record per key and partition instead of one per input. Runs after dead-branch
removal and before fusion (fusion then pulls the partial combine into its producer's pass).
Skipping it costs only speed. A combine whose ``CombineFn.liftable`` is False is left alone.

Windowed combines lift too: the partial assigns windows and folds per key and window (sessions
merge within the partial), so one partial per key, window and partition crosses the shuffle.
A windowed combine that fires a late pane per record is not lifted (a partial would fold
several late records into one pane).

Example, a count per key (the exchange ``n/exchange`` then reads the partial):

>>> from onceflow import Pipeline, sinks, sources
>>> p = Pipeline("example")
>>> keyed = p.read("src", sources.Collection([1, 2, 3])).key_by("k", str)
>>> keyed.combine_per_key("n", "count").write("out", sinks.Collect())
>>> plan = p.plan(rules=())
>>> [s.nodes for s in plan.ordered]
[('src',), ('k',), ('n',), ('out',)]
>>> after = lift_combiners(plan)
>>> [s.nodes for s in after.ordered]
[('src',), ('k',), ('n/partial',), ('n',), ('out',)]
>>> after.graph["n/exchange"].inputs
('n/partial',)
"""

from __future__ import annotations

from dataclasses import replace

from onceflow.graph_optimizer.ir import Combine, Exchange, Node, Phase
from onceflow.graph_optimizer.plan import Plan, Stage
from onceflow.kernel.windows import Late

PARTIAL_SUFFIX = "/partial"


def lift_combiners(plan: Plan) -> Plan:
    """Return ``plan`` with every liftable full combine split around its exchange."""
    graph = plan.graph
    targets = [n for n in graph if _liftable(plan, n)]
    if not targets:
        return plan
    nodes: dict[str, Node] = {n.name: n for n in graph}
    new_stages = list(plan.stages)
    for combine in targets:
        assert isinstance(combine, Combine)
        exchange = graph[combine.inputs[0]]
        partial = Combine(
            name=combine.name + PARTIAL_SUFFIX,
            inputs=exchange.inputs,
            label=f"partial {combine.label}",
            combine_fn=combine.combine_fn,
            phase=Phase.PARTIAL,
            windowing=combine.windowing,
        )
        nodes[partial.name] = partial
        nodes[exchange.name] = replace(exchange, inputs=(partial.name,))
        nodes[combine.name] = replace(combine, phase=Phase.FINAL, label=f"final {combine.label}")
        new_stages.append(Stage((partial.name,)))
    new_graph = graph.replace_nodes(nodes.values())
    return replace(plan, graph=new_graph).with_stages(new_stages)


def _liftable(plan: Plan, node: Node) -> bool:
    if not isinstance(node, Combine) or node.phase is not Phase.FULL:
        return False
    if node.combine_fn is None or not node.combine_fn.liftable:
        return False
    if node.windowing is not None and node.windowing.trigger.late_mode is Late.RECORD:
        return False
    exchange = plan.graph[node.inputs[0]]
    return isinstance(exchange, Exchange) and plan.graph.consumers[exchange.name] == (node.name,)
