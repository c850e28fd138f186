"""A stage described for the workers: what runs in which order and where outputs go.

The driver turns each physical stage into a :class:`StageSpec` (plain, picklable data plus
the user's functions); the executor-side :mod:`graph_optimizer.compile.body` builds its ops
from it. Outputs of a stage are *targets*, numbered: first the ports read by other stages,
then the sinks inside the stage, and last the stage's dead-letter output.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from graph_optimizer.combine_fn import CombineFn
from graph_optimizer.ir import Combine, Exchange, FlatMap, Phase, Sink, Source
from graph_optimizer.plan import Plan, Stage, Via

DEAD_LETTERS = "dead-letters"


class TargetKind(enum.Enum):
    """What a stage output feeds."""

    PORT = "port"  # another stage, directly or through an exchange
    SINK = "sink"  # a sink writing from the workers
    DRIVER = "driver"  # a sink whose records go back to the driver (Collect)
    DEAD = "dead"  # the pipeline's dead-letter sink


@dataclass(frozen=True)
class TargetSpec:
    """One output of a stage."""

    index: int
    kind: TargetKind
    name: str  # boundary name: exchange, producing node, or sink name
    keyed: bool
    connector: Any = None

    @property
    def to_driver(self) -> bool:
        """Records of this target travel back to the driver instead of being written."""
        return self.kind is TargetKind.DRIVER or (
            self.kind is TargetKind.DEAD and bool(getattr(self.connector, "to_driver", False))
        )

    @property
    def is_row(self) -> bool:
        """Records of this target leave the task as Spark rows (ports and driver sinks)."""
        return self.kind is TargetKind.PORT or self.to_driver


@dataclass(frozen=True)
class OpSpec:
    """One logical node running in the stage, with where its outputs go.

    ``to_ops`` names in-stage consumer ops; ``to_targets`` indexes stage outputs.
    """

    name: str
    kind: str  # "flat_map" or "combine"
    to_ops: tuple[str, ...]
    to_targets: tuple[int, ...]
    fn: Callable[..., Iterable[Any]] | None = None
    timestamped: bool = False
    combine_fn: CombineFn | None = None
    phase: Phase = Phase.FULL


@dataclass(frozen=True)
class InboundSpec:
    """An input of the stage: rows tagged ``port == index`` feed ``entries``."""

    index: int
    keyed: bool
    entries: tuple[str, ...]  # op names
    entry_targets: tuple[int, ...]  # sinks fed directly by the input


@dataclass(frozen=True)
class StageSpec:
    """Everything a worker needs to run one fused stage."""

    pipeline: str
    name: str
    ops: tuple[OpSpec, ...]
    inbound: tuple[InboundSpec, ...]
    targets: tuple[TargetSpec, ...]
    source: str | None = None  # source node name for source stages
    source_connector: Any = None
    on_error: str = "dead_letter"
    max_record_bytes: int = 1 << 20

    @property
    def stateful(self) -> tuple[OpSpec, ...]:
        """Combines that keep per-key state across micro-batches in streaming runs."""
        return tuple(o for o in self.ops if o.kind == "combine" and o.phase is not Phase.PARTIAL)

    @property
    def dead_target(self) -> int:
        """Index of the dead-letter output."""
        return self.targets[-1].index


def stage_spec(
    plan: Plan,
    stage: Stage,
    *,
    dead_letters: Any,
    on_error: str = "dead_letter",
    max_record_bytes: int = 1 << 20,
) -> StageSpec:
    """Describe ``stage`` of ``plan`` for the workers."""
    graph = plan.graph
    members = set(stage.nodes)
    targets = _targets(plan, stage, dead_letters)
    port_index = {t.name: t.index for t in targets if t.kind is TargetKind.PORT}
    sinks = (TargetKind.SINK, TargetKind.DRIVER)
    sink_index = {t.name: t.index for t in targets if t.kind in sinks}

    def outputs_of(name: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
        ops: list[str] = []
        outs: list[int] = []
        for c in graph.consumers[name]:
            node = graph[c]
            if isinstance(node, Sink) and c in members:
                outs.append(sink_index[c])
            elif c in members:
                ops.append(c)
            else:
                boundary = c if isinstance(node, Exchange) else name
                idx = port_index[boundary]
                if idx not in outs:
                    outs.append(idx)
        return tuple(ops), tuple(outs)

    ops: list[OpSpec] = []
    source: str | None = None
    source_connector = None
    for name in stage.nodes:
        node = graph[name]
        if isinstance(node, Source):
            source, source_connector = name, node.connector
            continue
        if isinstance(node, Sink):
            continue
        to_ops, to_targets = outputs_of(name)
        if isinstance(node, FlatMap):
            ops.append(
                OpSpec(name, "flat_map", to_ops, to_targets, fn=node.fn, timestamped=_ts(node))
            )
        elif isinstance(node, Combine):
            ops.append(
                OpSpec(
                    name,
                    "combine",
                    to_ops,
                    to_targets,
                    combine_fn=node.combine_fn,
                    phase=node.phase,
                )
            )
    inbound = _inbound(plan, stage, outputs_of, sink_index)
    return StageSpec(
        pipeline=graph.name,
        name=stage.name,
        ops=tuple(ops),
        inbound=inbound,
        targets=targets,
        source=source,
        source_connector=source_connector,
        on_error=on_error,
        max_record_bytes=max_record_bytes,
    )


def _ts(node: FlatMap) -> bool:
    return bool(getattr(node.fn, "onceflow_timestamped", False))


def _targets(plan: Plan, stage: Stage, dead_letters: Any) -> tuple[TargetSpec, ...]:
    graph = plan.graph
    out: list[TargetSpec] = []
    for port in plan.ports(stage):
        keyed = graph.keyed[port.producer] or port.via is Via.EXCHANGE
        out.append(TargetSpec(len(out), TargetKind.PORT, port.name, keyed))
    for name in stage.nodes:
        node = graph[name]
        if isinstance(node, Sink):
            kind = TargetKind.DRIVER if node.connector.to_driver else TargetKind.SINK
            keyed = graph.keyed[node.inputs[0]]
            out.append(TargetSpec(len(out), kind, name, keyed, node.connector))
    out.append(
        TargetSpec(len(out), TargetKind.DEAD, f"{stage.name}/{DEAD_LETTERS}", False, dead_letters)
    )
    return tuple(out)


def _inbound(
    plan: Plan,
    stage: Stage,
    outputs_of: Callable[[str], tuple[tuple[str, ...], tuple[int, ...]]],
    sink_index: dict[str, int],
) -> tuple[InboundSpec, ...]:
    """Group the stage's inbound edges by the upstream port they come from."""
    graph = plan.graph
    if plan.is_source_stage(stage):
        ops, outs = outputs_of(stage.nodes[0])
        return (InboundSpec(0, False, ops, outs),)
    groups: dict[tuple[str, str | None], tuple[list[str], list[int]]] = {}
    for e in plan.inbound(stage):
        entry_ops, entry_sinks = groups.setdefault((e.producer, e.exchange), ([], []))
        if isinstance(graph[e.consumer], Sink):
            entry_sinks.append(sink_index[e.consumer])
        elif e.consumer not in entry_ops:
            entry_ops.append(e.consumer)
    result = []
    for i, ((producer, exchange), (entry_ops, entry_sinks)) in enumerate(groups.items()):
        keyed = graph.keyed[producer] or exchange is not None
        result.append(InboundSpec(i, keyed, tuple(entry_ops), tuple(entry_sinks)))
    return tuple(result)


def inbound_ports(plan: Plan, stage: Stage) -> tuple[tuple[str, str], ...]:
    """For each inbound index of ``stage``: (producer stage name, boundary name).

    The compiler uses it to pick, from each producer's output, the rows of the right port.
    """
    seen: list[tuple[str, str]] = []
    for e in plan.inbound(stage):
        boundary = e.exchange if e.exchange is not None else e.producer
        item = (plan.stage_of[e.producer], boundary)
        if item not in seen:
            seen.append(item)
    return tuple(seen)
