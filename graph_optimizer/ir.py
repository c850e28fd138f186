"""The logical graph: six primitives every user-facing transform is built from.

``Source`` and ``Sink`` touch the outside world, ``FlatMap`` is any element-wise step (map,
filter, key_by and merge are flat-maps), ``Exchange`` repartitions a keyed stream by key,
``Combine`` folds values per key, and ``Process`` runs a user's function with per-key state
and timers. Nodes are frozen and name their inputs, so a graph is a
value: rules build new graphs instead of patching pointers.

Elements of a keyed stream are ``(key, value)`` tuples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from onceflow.graph_optimizer.errors import (
    CycleError,
    DuplicateStageError,
    GraphError,
    NoSinkError,
    NotKeyedError,
    UnknownInputError,
)
from onceflow.kernel.windows import Windowing
from onceflow.runtime.combine_fn import CombineFn
from onceflow.runtime.spec import Each, Phase
from onceflow.runtime.user_state import ProcessSpec

__all__ = [
    "Combine",
    "Each",
    "Exchange",
    "FlatMap",
    "Graph",
    "Node",
    "Phase",
    "Process",
    "Sink",
    "Source",
    "topological",
    "validate",
]


@dataclass(frozen=True)
class Node:
    """A named step; ``inputs`` are the names of the steps it reads."""

    name: str
    inputs: tuple[str, ...]
    label: str = field(default="", compare=False)

    @property
    def kind(self) -> str:
        """Primitive name, for plans and errors."""
        return type(self).__name__.lower()


@dataclass(frozen=True)
class Source(Node):
    """Reads records from outside."""

    connector: Any = None


@dataclass(frozen=True)
class FlatMap(Node):
    """Element-wise: each input element yields zero or more output elements.

    ``keyed`` says whether outputs are ``(key, value)`` pairs: True or False, or None to keep
    the keyedness of the input. A ``timestamped`` function is called as ``fn(element, ts)``
    with the record's event time in ms (window assignment needs it). A ``restamp`` node
    passes each element on unchanged with the event time ``fn(element)`` gives. ``each``
    says how ``fn`` makes the outputs (:class:`~onceflow.runtime.spec.Each`: a flat map's
    iterable, a map's one value, a filter's test ...; none for ``PASS``).
    """

    fn: Callable[..., Any] | None = None
    keyed: bool | None = None
    timestamped: bool = False
    restamp: bool = False
    each: Each = Each.FLAT


@dataclass(frozen=True)
class Exchange(Node):
    """Repartitions a keyed stream so that every key lives in one partition."""


@dataclass(frozen=True)
class Combine(Node):
    """Folds the values of each key with a :class:`CombineFn`.

    With ``windowing``, per key and event-time window, emitting panes; with ``ttl_ms``, a
    key's state is forgotten that long after its last update (streaming runs), and with
    ``expiry_deletes`` the key's expiry is sent on as ``(key, None)``, a delete to the sinks.
    """

    combine_fn: CombineFn | None = None
    phase: Phase = Phase.FULL
    windowing: Windowing | None = None
    ttl_ms: int | None = None
    expiry_deletes: bool = False


@dataclass(frozen=True)
class Process(Node):
    """Runs the user's function per record with per-key state and timers (``Stream.process``).

    Reads an exchange, as a combine does, so that each key's state lives in one partition;
    its outputs are whatever the function emits (unkeyed).
    """

    process: ProcessSpec | None = None


@dataclass(frozen=True)
class Sink(Node):
    """Writes records outside."""

    connector: Any = None


@dataclass(frozen=True)
class Graph:
    """A pipeline's logical graph: nodes in an order where inputs come first."""

    name: str
    nodes: tuple[Node, ...]

    @cached_property
    def by_name(self) -> Mapping[str, Node]:
        """Nodes by name."""
        return {n.name: n for n in self.nodes}

    @cached_property
    def consumers(self) -> Mapping[str, tuple[str, ...]]:
        """For each node, the names of the nodes reading it, in graph order."""
        out: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                if i in out and n.name not in out[i]:
                    out[i].append(n.name)
        return {k: tuple(v) for k, v in out.items()}

    @cached_property
    def keyed(self) -> Mapping[str, bool]:
        """Whether each node's output elements are ``(key, value)`` pairs."""
        result: dict[str, bool] = {}
        for n in self.nodes:
            result[n.name] = _output_keyed(n, [result.get(i, False) for i in n.inputs])
        return result

    def __getitem__(self, name: str) -> Node:
        return self.by_name[name]

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def sources(self) -> tuple[Source, ...]:
        """The source nodes."""
        return tuple(n for n in self.nodes if isinstance(n, Source))

    def sinks(self) -> tuple[Sink, ...]:
        """The sink nodes."""
        return tuple(n for n in self.nodes if isinstance(n, Sink))

    def replace_nodes(self, nodes: Iterable[Node]) -> Graph:
        """A new graph with these nodes, re-sorted so that inputs come first."""
        return replace(self, nodes=topological(tuple(nodes)))


def _output_keyed(node: Node, inputs_keyed: list[bool]) -> bool:
    if isinstance(node, Source | Sink):
        return False
    if isinstance(node, Combine):
        return True
    if isinstance(node, Process):
        return False
    if isinstance(node, FlatMap) and node.keyed is not None:
        return node.keyed
    return all(inputs_keyed) if inputs_keyed else False


def topological(nodes: tuple[Node, ...]) -> tuple[Node, ...]:
    """Order nodes so that every node follows its inputs, keeping the given order otherwise.

    Raises :class:`CycleError` naming the stages on a cycle.
    """
    by_name = {n.name: n for n in nodes}
    state: dict[str, int] = {}  # 1 = visiting, 2 = done
    ordered: list[Node] = []

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            cycle = [*path[path.index(name) :], name]
            msg = (
                f"stages form a cycle: {' -> '.join(cycle)}; a stage may only read stages "
                "declared before it"
            )
            raise CycleError(msg)
        state[name] = 1
        for i in by_name[name].inputs:
            if i in by_name:
                visit(i, [*path, name])
        state[name] = 2
        ordered.append(by_name[name])

    for n in nodes:
        visit(n.name, [])
    return tuple(ordered)


def validate(graph: Graph) -> Graph:
    """Check a graph and return it sorted; every error says what to change."""
    _check_unique(graph.nodes)
    _check_inputs(graph.nodes)
    graph = Graph(graph.name, topological(graph.nodes))
    _check_arity(graph)
    _check_keyed(graph)
    if not graph.sinks():
        msg = (
            f"pipeline {graph.name!r} writes nothing: add a sink (for example "
            "stream.write('out', sinks.Collect())) so that its results go somewhere"
        )
        raise NoSinkError(msg)
    return graph


def _check_unique(nodes: tuple[Node, ...]) -> None:
    seen: set[str] = set()
    for n in nodes:
        if not n.name or not isinstance(n.name, str):
            msg = f"every stage needs a non-empty string name, found {n.name!r}"
            raise GraphError(msg)
        if n.name in seen:
            msg = f"stage {n.name!r} is declared twice; give each stage a unique name"
            raise DuplicateStageError(msg)
        seen.add(n.name)


def _check_inputs(nodes: tuple[Node, ...]) -> None:
    names = {n.name for n in nodes}
    for n in nodes:
        for i in n.inputs:
            if i not in names:
                msg = (
                    f"stage {n.name!r} reads {i!r}, which is not a stage of this pipeline; "
                    "read a stream returned by this pipeline's own transforms"
                )
                raise UnknownInputError(msg)


def _check_arity(graph: Graph) -> None:
    for n in graph:
        if isinstance(n, Source) and n.inputs:
            msg = f"source {n.name!r} cannot read other stages; it reads from outside only"
            raise GraphError(msg)
        if not isinstance(n, Source) and not n.inputs:
            msg = f"stage {n.name!r} reads nothing; give it an input stream"
            raise GraphError(msg)
        if isinstance(n, Exchange | Combine | Process | Sink) and len(n.inputs) != 1:
            msg = (
                f"{n.kind} {n.name!r} reads {len(n.inputs)} streams but takes exactly one; "
                "merge them first"
            )
            raise GraphError(msg)
        if isinstance(n, Sink) and graph.consumers[n.name]:
            readers = ", ".join(repr(c) for c in graph.consumers[n.name])
            msg = f"sink {n.name!r} is read by {readers}; a sink has no output to read"
            raise GraphError(msg)


def _check_keyed(graph: Graph) -> None:
    keyed = graph.keyed
    for n in graph:
        if isinstance(n, Exchange | Combine | Process) and not keyed[n.inputs[0]]:
            msg = (
                f"{n.kind} {n.name!r} needs a keyed stream but {n.inputs[0]!r} is not keyed; "
                f"add .key_by(...) before {n.name!r}"
            )
            raise NotKeyedError(msg)
        if (isinstance(n, Combine) and n.phase is not Phase.PARTIAL) or isinstance(n, Process):
            if not isinstance(graph[n.inputs[0]], Exchange):
                msg = (
                    f"combine {n.name!r} must read an exchange (so each key is in one "
                    f"partition), but reads {graph[n.inputs[0]].kind} {n.inputs[0]!r}"
                )
                raise GraphError(msg)
        if isinstance(n, Combine) and n.phase is Phase.PARTIAL:
            bad = [c for c in graph.consumers[n.name] if not isinstance(graph[c], Exchange)]
            if bad:
                msg = f"partial combine {n.name!r} may only feed exchanges, not {bad}"
                raise GraphError(msg)
        if isinstance(n, FlatMap) and len(n.inputs) > 1:
            kinds = {keyed[i] for i in n.inputs}
            if len(kinds) > 1:
                msg = (
                    f"merge {n.name!r} mixes keyed and unkeyed streams ({', '.join(n.inputs)});"
                    " key them all the same way first"
                )
                raise NotKeyedError(msg)
