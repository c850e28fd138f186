"""An independent, in-memory evaluator of a logical graph (bounded semantics).

It shares nothing with the compiler or the stage runtime: nodes are evaluated one by one over
Python lists. The execution tests compare Spark's results, optimized and not, against it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from onceflow.connectors.collections import Collection, Generate
from onceflow.graph_optimizer.ir import (
    Combine,
    Each,
    Exchange,
    FlatMap,
    Graph,
    Phase,
    Sink,
    Source,
)
from onceflow.kernel import codec


def evaluate(graph: Graph) -> dict[str, list[Any]]:
    """Elements reaching each sink."""
    values: dict[str, list[Any]] = {}
    results: dict[str, list[Any]] = {}
    for node in graph:
        if isinstance(node, Source):
            values[node.name] = _source(node.connector)
        elif isinstance(node, FlatMap):
            out: list[Any] = []
            for i in node.inputs:
                for x in values[i]:
                    out.extend(_outputs(node, x))
            values[node.name] = out
        elif isinstance(node, Exchange):
            values[node.name] = list(values[node.inputs[0]])
        elif isinstance(node, Combine):
            assert node.phase is Phase.FULL
            fn = node.combine_fn
            groups: dict[bytes, list[Any]] = {}
            for k, v in values[node.inputs[0]]:
                entry = groups.setdefault(codec.encode(k), [k, fn.create()])
                entry[1] = fn.add(entry[1], v)
            values[node.name] = [(k, fn.extract(acc)) for k, acc in groups.values()]
        elif isinstance(node, Sink):
            results[node.name] = list(values[node.inputs[0]])
    return results


def _outputs(node: FlatMap, x: Any) -> list[Any]:
    """What an element-wise node makes of one element (event time 0)."""
    fn = node.fn
    args = (x, 0) if node.timestamped else (x,)
    if node.each is Each.PASS:
        return [x]
    assert fn is not None
    if node.each is Each.MAP:
        return [fn(*args)]
    if node.each is Each.FILTER:
        return [x] if fn(x) else []
    if node.each is Each.KEY_BY:
        return [(fn(x), x)]
    if node.each is Each.MAP_VALUES:
        return [(x[0], fn(x[1]))]
    return list(fn(*args))


def _source(connector: Any) -> list[Any]:
    if isinstance(connector, Collection):
        return [codec.decode(b) for b in connector.encoded]
    if isinstance(connector, Generate):
        return [connector.fn(i) if connector.fn else i for i in range(connector.count)]
    raise NotImplementedError(type(connector).__name__)


def multiset(values: list[Any]) -> Counter[Any]:
    """Order-insensitive form of a sink's output (lists become tuples to be hashable)."""

    def freeze(v: Any) -> Any:
        if isinstance(v, list | tuple):
            return tuple(freeze(x) for x in v)
        return v

    return Counter(freeze(v) for v in values)
