"""The physical plan: fused stages separated by boundaries.

A stage is a set of logical nodes that run in one Python pass per partition. Exchange nodes
belong to no stage: they *are* the boundaries where Spark repartitions by key. What crosses
from one stage to another, and what enters a sink, crosses a *boundary*; the exactly-once
runtime backs records up before each boundary and deduplicates them after it, so the plan
lists boundaries explicitly (:meth:`Plan.boundaries`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property

from onceflow.graph_optimizer.ir import Exchange, Graph, Sink, Source


@dataclass(frozen=True)
class Stage:
    """Logical nodes fused into one pass; ``nodes`` follow graph order.

    ``label``: a name of the stage's own, independent of its nodes' names (siblings fused
    into one stage, see :mod:`~.rules.fuse_siblings`); None: named after its first node.
    """

    nodes: tuple[str, ...]
    label: str | None = None

    @property
    def name(self) -> str:
        """The stage's name (Redis keys derive from it): its label, else its first node's."""
        return self.label or self.nodes[0]


class Via(enum.Enum):
    """How records reach a node of another stage."""

    DIRECT = "direct"  # same partitioning, no shuffle (an unfused element-wise edge)
    EXCHANGE = "exchange"  # repartitioned by key


@dataclass(frozen=True)
class Inbound:
    """An edge entering a stage: ``producer`` (another stage) feeds ``consumer`` (this one)."""

    producer: str
    consumer: str
    via: Via
    exchange: str | None = None


@dataclass(frozen=True)
class Port:
    """An output of a stage: what ``producer`` emits towards other stages.

    ``name`` names the boundary (the exchange, or the producing node for direct edges); child
    record IDs are derived from it.
    """

    producer: str
    via: Via
    exchange: str | None = None

    @property
    def name(self) -> str:
        """Boundary name used for ID derivation and for display."""
        return self.exchange if self.exchange is not None else self.producer


class BoundaryKind(enum.Enum):
    """Where exactly-once work happens."""

    SOURCE = "source"
    EXCHANGE = "exchange"
    DIRECT = "direct"
    SINK = "sink"


@dataclass(frozen=True)
class Boundary:
    """A place where records are backed up by the sender and deduplicated by the receiver."""

    kind: BoundaryKind
    name: str
    sender: str | None  # stage name, None for sources
    receiver: str  # stage name, or the sink node for sinks


@dataclass(frozen=True)
class Plan:
    """An optimized (or not) logical graph and its stages."""

    graph: Graph
    stages: tuple[Stage, ...]
    removed: tuple[str, ...] = field(default=())

    @cached_property
    def stage_of(self) -> Mapping[str, str]:
        """Stage name of every node that runs in a stage."""
        return {n: s.name for s in self.stages for n in s.nodes}

    @cached_property
    def by_name(self) -> Mapping[str, Stage]:
        """Stages by name."""
        return {s.name: s for s in self.stages}

    def inbound(self, stage: Stage) -> tuple[Inbound, ...]:
        """Edges entering ``stage`` from other stages (empty for a source stage)."""
        members = set(stage.nodes)
        edges: list[Inbound] = []
        for name in stage.nodes:
            for i in self.graph[name].inputs:
                node = self.graph[i]
                if isinstance(node, Exchange):
                    edges.append(Inbound(node.inputs[0], name, Via.EXCHANGE, node.name))
                elif i not in members:
                    edges.append(Inbound(i, name, Via.DIRECT))
        return tuple(edges)

    def ports(self, stage: Stage) -> tuple[Port, ...]:
        """Outputs of ``stage`` read by other stages, in a stable order."""
        members = set(stage.nodes)
        found: list[Port] = []
        for name in stage.nodes:
            for c in self.graph.consumers[name]:
                node = self.graph[c]
                if isinstance(node, Exchange):
                    port = Port(name, Via.EXCHANGE, node.name)
                elif c not in members:
                    port = Port(name, Via.DIRECT)
                else:
                    continue
                if port not in found:
                    found.append(port)
        return tuple(found)

    def producer_stages(self, stage: Stage) -> tuple[str, ...]:
        """Names of the stages ``stage`` reads, in order of first appearance."""
        seen: list[str] = []
        for e in self.inbound(stage):
            s = self.stage_of[e.producer]
            if s not in seen:
                seen.append(s)
        return tuple(seen)

    def is_source_stage(self, stage: Stage) -> bool:
        """True when the stage starts at a source."""
        return isinstance(self.graph[stage.nodes[0]], Source)

    @cached_property
    def ordered(self) -> tuple[Stage, ...]:
        """Stages in an order where producers come first."""
        position = {n.name: i for i, n in enumerate(self.graph.nodes)}
        return tuple(sorted(self.stages, key=lambda s: min(position[n] for n in s.nodes)))

    def consumers_of(self, stage: Stage) -> tuple[Stage, ...]:
        """Stages reading ``stage``."""
        return tuple(s for s in self.ordered if stage.name in self.producer_stages(s))

    def boundaries(self) -> tuple[Boundary, ...]:
        """Every place records are backed up and deduplicated, in plan order."""
        out: list[Boundary] = []
        for stage in self.ordered:
            if self.is_source_stage(stage):
                out.append(Boundary(BoundaryKind.SOURCE, stage.nodes[0], None, stage.name))
            for e in self.inbound(stage):
                kind = BoundaryKind.EXCHANGE if e.via is Via.EXCHANGE else BoundaryKind.DIRECT
                name = e.exchange if e.exchange is not None else e.producer
                b = Boundary(kind, name, self.stage_of[e.producer], stage.name)
                if b not in out:
                    out.append(b)
            for n in stage.nodes:
                if isinstance(self.graph[n], Sink):
                    out.append(Boundary(BoundaryKind.SINK, n, stage.name, n))
        return tuple(out)

    def with_stages(self, stages: Iterable[Stage]) -> Plan:
        """A plan with new stages (each stage's nodes re-sorted into graph order)."""
        position = {n.name: i for i, n in enumerate(self.graph.nodes)}
        fixed = tuple(
            Stage(tuple(sorted(s.nodes, key=position.__getitem__)), s.label) for s in stages
        )
        return replace(self, stages=fixed)


def initial_plan(graph: Graph) -> Plan:
    """The unoptimized plan: every node except exchanges is a stage of its own."""
    stages = tuple(Stage((n.name,)) for n in graph if not isinstance(n, Exchange))
    return Plan(graph, stages)


def merge_stages(plan: Plan, names: Iterable[str], label: str | None = None) -> Plan:
    """Fuse the named stages into one; the others are kept in order.

    The fused stage is called ``label``, else what the first named stage was called.
    """
    wanted = list(names)
    first_label = label if label is not None else plan.by_name[wanted[0]].label
    fused = Stage(tuple(n for s in wanted for n in plan.by_name[s].nodes), first_label)
    first = True
    stages: list[Stage] = []
    for s in plan.stages:
        if s.name in wanted:
            if first:
                stages.append(fused)
                first = False
        else:
            stages.append(s)
    return plan.with_stages(stages)
