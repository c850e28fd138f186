"""Lowering: a physical plan becomes the runtime's :class:`~onceflow.runtime.spec.Job`.

Each fused stage becomes a :class:`~onceflow.runtime.spec.StageSpec`: its ops in graph order,
its inputs (which producing stage and port each comes from, and whether they arrive through
an exchange) and its targets (ports to other stages, then sinks, then the dead-letter output).
Runs after optimization; nothing here changes the plan. The job also carries the plan's
layout and fingerprint (:mod:`onceflow.graph_optimizer.fingerprint`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from onceflow.graph_optimizer.fingerprint import fingerprint, layout
from onceflow.graph_optimizer.ir import Combine, Exchange, FlatMap, Process, Sink, Source
from onceflow.graph_optimizer.plan import Plan, Stage, Via
from onceflow.kernel.limits import RECORD_BYTES
from onceflow.kernel.record_types import visible_types
from onceflow.runtime.spec import (
    DEAD_LETTERS,
    InboundSpec,
    Job,
    OpKind,
    OpSpec,
    StageSpec,
    TargetKind,
    TargetSpec,
)

Outputs = Callable[[str], tuple[tuple[str, ...], tuple[int, ...]]]


def lower(
    plan: Plan,
    *,
    on_error: str = "dead_letter",
    max_record_bytes: int = RECORD_BYTES,
    dead_letters: Any = None,
    dedup: Any = None,
    event_time: Any = None,
) -> Job:
    """The job that runs ``plan``; the keyword settings are the pipeline's own."""
    specs: dict[str, StageSpec] = {}
    for stage in plan.ordered:
        specs[stage.name] = stage_spec(
            plan, stage, specs, on_error=on_error, max_record_bytes=max_record_bytes
        )
    records = visible_types(
        getattr(node, attr, None) for node in plan.graph.nodes for attr in ("fn", "combine_fn")
    )
    specs = {name: replace(spec, record_types=records) for name, spec in specs.items()}
    sinks: list[Any] = []
    for node in plan.graph.sinks():
        if all(node.connector is not s for s in sinks):
            sinks.append(node.connector)
    described = layout(plan)
    return Job(
        pipeline=plan.graph.name,
        stages=tuple(specs[s.name] for s in plan.ordered),
        sources=tuple((n.name, n.connector) for n in plan.graph.sources()),
        sinks=tuple(sinks),
        layout=described,
        fingerprint=fingerprint(described),
        dead_letters=dead_letters,
        dedup=dedup,
        event_time=event_time,
        removed=plan.removed,
    )


def stage_spec(
    plan: Plan,
    stage: Stage,
    producers: dict[str, StageSpec],
    *,
    on_error: str = "dead_letter",
    max_record_bytes: int = RECORD_BYTES,
) -> StageSpec:
    """Describe ``stage`` of ``plan`` for the workers (``producers``: specs lowered so far)."""
    graph = plan.graph
    members = set(stage.nodes)
    targets = _targets(plan, stage)
    port_index = {t.name: t.index for t in targets if t.kind is TargetKind.PORT}
    sink_index = {
        t.name: t.index for t in targets if t.kind in (TargetKind.SINK, TargetKind.DRIVER)
    }

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
                idx = port_index[c if isinstance(node, Exchange) else name]
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
        elif isinstance(node, FlatMap):
            to_ops, to_targets = outputs_of(name)
            ops.append(
                OpSpec(
                    name,
                    OpKind.FLAT_MAP,
                    to_ops,
                    to_targets,
                    fn=node.fn,
                    timestamped=node.timestamped,
                    restamp=node.restamp,
                    each=node.each,
                )
            )
        elif isinstance(node, Combine):
            to_ops, to_targets = outputs_of(name)
            ops.append(
                OpSpec(
                    name,
                    OpKind.COMBINE,
                    to_ops,
                    to_targets,
                    combine_fn=node.combine_fn,
                    phase=node.phase,
                    windowing=node.windowing,
                    ttl_ms=node.ttl_ms,
                    expiry_deletes=node.expiry_deletes,
                )
            )
        elif isinstance(node, Process):
            to_ops, to_targets = outputs_of(name)
            ops.append(OpSpec(name, OpKind.PROCESS, to_ops, to_targets, process=node.process))
    return StageSpec(
        pipeline=graph.name,
        name=stage.name,
        ops=tuple(ops),
        inbound=_inbound(plan, stage, outputs_of, sink_index, producers),
        targets=targets,
        source=source,
        source_connector=source_connector,
        exchange=any(e.via is Via.EXCHANGE for e in plan.inbound(stage)),
        on_error=on_error,
        max_record_bytes=max_record_bytes,
    )


def _targets(plan: Plan, stage: Stage) -> tuple[TargetSpec, ...]:
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
    out.append(TargetSpec(len(out), TargetKind.DEAD, f"{stage.name}/{DEAD_LETTERS}", False))
    return tuple(out)


def _inbound(
    plan: Plan,
    stage: Stage,
    outputs_of: Outputs,
    sink_index: dict[str, int],
    producers: dict[str, StageSpec],
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
        producer_stage = plan.stage_of[producer]
        boundary = exchange if exchange is not None else producer
        port = next(t.index for t in producers[producer_stage].targets if t.name == boundary)
        keyed = graph.keyed[producer] or exchange is not None
        result.append(
            InboundSpec(i, keyed, tuple(entry_ops), tuple(entry_sinks), producer_stage, port)
        )
    return tuple(result)
