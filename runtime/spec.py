"""What the runtime executes: a :class:`Job` of stages, each described by a :class:`StageSpec`.

This is the runtime's instruction set. The optimizer lowers a physical plan into a ``Job``
(:mod:`onceflow.graph_optimizer.lower`); the runtime never sees the logical graph or the plan.
A stage is plain, picklable data plus the user's functions; the executor-side
:mod:`onceflow.runtime.ops.body` builds its ops from it. Outputs of a stage are *targets*,
numbered: first the ports read by other stages, then the sinks inside the stage, and last the
stage's dead-letter output. A stage's inputs name the producing stage and port; a stage whose
inputs arrive through an exchange has them repartitioned by key first.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from onceflow.kernel.limits import RECORD_BYTES
from onceflow.kernel.windows import Windowing
from onceflow.runtime.combine_fn import CombineFn
from onceflow.runtime.user_state import ProcessSpec

DEAD_LETTERS = "dead-letters"


class TargetKind(enum.Enum):
    """What a stage output feeds."""

    PORT = "port"  # another stage, directly or through an exchange
    SINK = "sink"  # a sink writing from the workers
    DRIVER = "driver"  # a sink whose records go back to the driver (Collect)
    DEAD = "dead"  # the pipeline's dead-letter sink


class OpKind(enum.Enum):
    """What an op can be: element-wise, a fold per key, or user state per key."""

    FLAT_MAP = "flat_map"
    COMBINE = "combine"
    PROCESS = "process"  # Stream.process: the user's function with per-key state and timers


class Each(enum.Enum):
    """How an element-wise op applies its function ``fn``; a fused stage runs it on a chunk.

    The shape is what lets a stage apply a ``map`` to a chunk's list of elements at once
    instead of calling a wrapper per element (:mod:`onceflow.runtime.ops.each`).
    """

    FLAT = "flat"  # fn(x) -> an iterable of outputs (flat_map, joins)
    MAP = "map"  # fn(x) -> one output
    FILTER = "filter"  # x, if fn(x) is true
    KEY_BY = "key_by"  # (fn(x), x)
    MAP_VALUES = "map_values"  # (x[0], fn(x[1]))
    PASS = "pass"  # x itself, no function (merge, window)


class Phase(enum.Enum):
    """Where a combine runs relative to its exchange."""

    FULL = "full"  # after the exchange, folding raw values
    PARTIAL = "partial"  # before the exchange, emitting accumulators (lifted)
    FINAL = "final"  # after the exchange, merging accumulators (lifted)


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

    ``to_ops`` names in-stage consumer ops; ``to_targets`` indexes stage outputs. An
    element-wise op applies ``fn`` as ``each`` says (:class:`Each`); a ``timestamped`` one is
    called as ``fn(element, event_time_ms)``. A combine with
    ``windowing`` folds per key and window (:mod:`onceflow.runtime.ops.windowed_combine`); one
    with a
    ``ttl_ms`` forgets a key's state that long (of batch time) after its last update (and
    sends ``(key, None)`` on then, with ``expiry_deletes``). A
    process op runs ``process`` (:mod:`onceflow.runtime.ops.process`).
    """

    name: str
    kind: OpKind
    to_ops: tuple[str, ...]
    to_targets: tuple[int, ...]
    fn: Callable[..., Iterable[Any]] | None = None
    timestamped: bool = False
    combine_fn: CombineFn | None = None
    phase: Phase = Phase.FULL
    windowing: Windowing | None = None
    ttl_ms: int | None = None
    expiry_deletes: bool = False
    process: ProcessSpec | None = None
    restamp: bool = False  # a flat map that gives its element a new event time: fn(element)
    each: Each = Each.FLAT


@dataclass(frozen=True)
class InboundSpec:
    """An input of the stage: rows tagged ``port == index`` feed ``entries``.

    ``producer`` and ``port`` say where the rows come from: the producing stage and the
    index of its target (empty and -1 for a source stage's input).
    """

    index: int
    keyed: bool
    entries: tuple[str, ...]  # op names
    entry_targets: tuple[int, ...]  # sinks fed directly by the input
    producer: str = ""
    port: int = -1


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
    exchange: bool = False  # inputs are repartitioned by key before the stage runs
    on_error: str = "dead_letter"
    max_record_bytes: int = RECORD_BYTES
    # the user's record classes (dataclasses ...) the pipeline's functions see: registered in
    # the worker before a record is read (see onceflow.kernel.record_types)
    record_types: tuple[type, ...] = ()

    @property
    def dead_target(self) -> int:
        """Index of the dead-letter output."""
        return self.targets[-1].index

    @property
    def producers(self) -> tuple[str, ...]:
        """Names of the stages this stage reads, in order of first appearance."""
        found: list[str] = []
        for i in self.inbound:
            if i.producer and i.producer not in found:
                found.append(i.producer)
        return tuple(found)

    @property
    def sinks(self) -> tuple[tuple[int, str], ...]:
        """``(target index, name)`` of every sink this stage writes from the workers."""
        return tuple((t.index, t.name) for t in self.targets if not t.is_row)

    def with_dead_letters(self, connector: Any) -> StageSpec:
        """This stage with its dead-letter output going to ``connector``."""
        dead = replace(self.targets[-1], connector=connector)
        return replace(self, targets=(*self.targets[:-1], dead))


@dataclass(frozen=True)
class Job:
    """A whole pipeline, ready to run: its stages (producers first) and its connectors.

    ``layout`` describes the physical plan (stages and boundaries) and ``fingerprint`` is its
    hash: streaming runs store it with the pipeline's state and refuse to resume a namespace
    with another plan, because stage names key record IDs, backups and dedup history.
    """

    pipeline: str
    stages: tuple[StageSpec, ...]
    sources: tuple[tuple[str, Any], ...]  # (source node name, connector), in stage order
    sinks: tuple[Any, ...]  # sink connectors, each once
    layout: dict[str, Any]
    fingerprint: str
    dead_letters: Any = None  # the pipeline's own dead-letter sink, if it names one
    dedup: Any = None  # the pipeline's DedupConfig, if it sets one
    event_time: Any = None  # the pipeline's EventTime (watermark settings), if it sets them
    removed: tuple[str, ...] = ()  # nodes the optimizer dropped (they reach no sink)

    @property
    def by_name(self) -> dict[str, StageSpec]:
        """Stages by name."""
        return {s.name: s for s in self.stages}

    @property
    def source_stages(self) -> tuple[str, ...]:
        """Names of the stages that start at a source."""
        return tuple(s.name for s in self.stages if s.source is not None)

    def consumers(self, stage: str) -> tuple[str, ...]:
        """Names of the stages reading ``stage``."""
        return tuple(s.name for s in self.stages if stage in s.producers)

    def with_dead_letters(self, connector: Any) -> Job:
        """This job with every stage's dead letters going to ``connector``."""
        return replace(self, stages=tuple(s.with_dead_letters(connector) for s in self.stages))

    def with_sources(self, connectors: dict[str, Any]) -> Job:
        """This job reading each named source through ``connectors[name]`` instead.

        Both places that hold a source's connector change: the job's sources (the driver
        streams them) and its source stage (the workers decode with it).
        """
        sources = tuple((name, connectors.get(name, c)) for name, c in self.sources)
        stages = tuple(
            replace(s, source_connector=connectors[s.source])
            if s.source is not None and s.source in connectors
            else s
            for s in self.stages
        )
        return replace(self, sources=sources, stages=stages)

    @property
    def bounded(self) -> bool:
        """True when every source ends."""
        return all(c.bounded for _, c in self.sources)

    def stateful_ops(self) -> list[tuple[StageSpec, OpSpec]]:
        """Every op that keeps state in a streaming run (not the lifted partials)."""
        return [
            (stage, op)
            for stage in self.stages
            for op in stage.ops
            if (op.kind is OpKind.COMBINE and op.phase is not Phase.PARTIAL)
            or op.kind is OpKind.PROCESS
        ]
