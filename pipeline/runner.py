"""Running a pipeline: bounded runs as one Spark job, streaming runs as a Spark query.

A bounded run (every source ends) reads each source once, runs the optimized plan as a single
Spark action with a progress bar, and returns a :class:`RunResult` whose summary lists records
in and out per stage and the dead letters. Streaming runs are in :mod:`pipeline.streaming`.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from connectors.files import JsonLinesSink
from graph_optimizer.compile.body import Mode
from graph_optimizer.compile.metrics import CounterParam
from graph_optimizer.compile.spark import compile_batch
from graph_optimizer.compile.task import no_guard
from graph_optimizer.ir import Sink
from graph_optimizer.optimizer import RULES
from pipeline.errors import ConfigError, RunError
from pipeline.progress import TaskProgress
from pipeline.session import spark_session

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from graph_optimizer.plan import Plan
    from pipeline.api import Pipeline

DEFAULT_OUTPUT_DIR = "onceflow-output"


@dataclass
class RunResult:
    """What a run did."""

    pipeline: str
    plan: Plan
    mode: Mode
    seconds: float
    counters: dict[str, int]
    dead_letter_sink: str
    batches: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    def counter(self, name: str) -> int:
        """Total of counters whose name ends with ``/name``."""
        return sum(n for k, n in self.counters.items() if k.endswith("/" + name))

    @property
    def records_in(self) -> int:
        """Records read by source stages."""
        sources = {s.name for s in self.plan.graph.sources()}
        stages = {self.plan.stage_of[s] for s in sources}
        return sum(self.counters.get(f"{s}/in", 0) for s in stages)

    @property
    def dead_letters(self) -> int:
        """Records sent to the dead-letter sink."""
        return self.counter("dead_letters")

    def stage_rows(self) -> list[tuple[str, int, int, int, int]]:
        """Per stage: (name, records in, records out, dead letters, duplicates dropped)."""
        rows = []
        for stage in self.plan.ordered:
            prefix = stage.name + "/"
            out = sum(
                n
                for k, n in self.counters.items()
                if k.startswith(prefix + "out/") and not k.endswith("/dead-letters")
            )
            rows.append(
                (
                    stage.name,
                    self.counters.get(prefix + "in", 0),
                    out,
                    self.counters.get(prefix + "dead_letters", 0),
                    self.counters.get(prefix + "duplicates_dropped", 0),
                )
            )
        return rows

    def summary(self) -> str:
        """A table of what each stage did, and the totals."""
        lines = [
            f"pipeline {self.pipeline!r}: {self.mode.value} run, {self.batches} batch(es), "
            f"{self.seconds:.1f} s",
            f"{'stage':<28} {'in':>10} {'out':>10} {'dead':>6} {'dups':>6}",
        ]
        for name, n_in, n_out, dead, dups in self.stage_rows():
            lines.append(f"{name:<28} {n_in:>10,} {n_out:>10,} {dead:>6,} {dups:>6,}")
        rate = self.records_in / self.seconds if self.seconds > 0 else 0.0
        lines.append(f"records in: {self.records_in:,} ({rate:,.0f}/s)")
        if self.dead_letters:
            lines.append(f"dead letters: {self.dead_letters:,} -> {self.dead_letter_sink}")
        else:
            lines.append("dead letters: 0")
        return "\n".join(lines)


def default_dead_letters(pipeline: Pipeline, output_dir: str) -> Any:
    """Where dead letters go when the pipeline names no sink for them."""
    if pipeline.dead_letters is not None:
        return pipeline.dead_letters
    return JsonLinesSink(os.path.join(output_dir, pipeline.name, "dead-letters.jsonl"))


def run(
    pipeline: Pipeline,
    *,
    master: str = "local[2]",
    parallelism: int = 2,
    rules: Sequence[Callable[[Plan], Plan]] | None = None,
    progress: bool = True,
    session: SparkSession | None = None,
    output_dir: str = DEFAULT_OUTPUT_DIR,
    **streaming: Any,
) -> RunResult:
    """Run ``pipeline``: bounded when every source ends, else a streaming query.

    ``rules`` picks optimizer rules (default: all; ``()`` runs the unoptimized plan). Streaming
    settings (Redis, checkpoint, trigger, guarantee) are described in
    :func:`pipeline.streaming.run_streaming`.
    """
    plan = pipeline.plan(RULES if rules is None else rules)
    if any(not s.connector.bounded for s in plan.graph.sources()):
        from pipeline.streaming import run_streaming

        return run_streaming(
            pipeline,
            plan,
            master=master,
            parallelism=parallelism,
            progress=progress,
            session=session,
            output_dir=output_dir,
            **streaming,
        )
    if streaming:
        names = ", ".join(sorted(streaming))
        msg = f"settings {names} only apply to streaming runs; every source here is bounded"
        raise ConfigError(msg)
    return run_bounded(
        pipeline,
        plan,
        master=master,
        parallelism=parallelism,
        progress=progress,
        session=session,
        output_dir=output_dir,
    )


def run_bounded(
    pipeline: Pipeline,
    plan: Plan,
    *,
    master: str,
    parallelism: int,
    progress: bool,
    session: SparkSession | None,
    output_dir: str,
) -> RunResult:
    """One Spark action over every source; see the module docstring."""
    spark = session or spark_session(master, app_name=pipeline.name, parallelism=parallelism)
    dead = default_dead_letters(pipeline, output_dir)
    sinks = _sink_connectors(plan, dead)
    for sink in sinks:
        sink.prepare(pipeline.name, False)
    sources = {}
    for node in plan.graph.sources():
        node.connector.prepare(pipeline.name, False)
        sources[node.name] = node.connector.frame(spark, parallelism)
    metrics = spark.sparkContext.accumulator({}, CounterParam())
    started = time.monotonic()
    compiled = compile_batch(
        plan,
        spark,
        sources,
        no_guard,
        batch=0,
        parallelism=parallelism,
        dead_letters=dead,
        metrics=metrics,
        on_error=pipeline.on_error,
        max_record_bytes=pipeline.max_record_bytes,
    )
    group = f"onceflow-{pipeline.name}-{uuid.uuid4().hex[:8]}"
    try:
        with TaskProgress(spark.sparkContext, group, enabled=progress):
            compiled.run()
    except Exception as exc:
        raise RunError(_explain_failure(pipeline.name, exc)) from exc
    for sink in sinks:
        sink.finish()
    return RunResult(
        pipeline=pipeline.name,
        plan=plan,
        mode=Mode.BOUNDED,
        seconds=time.monotonic() - started,
        counters=dict(metrics.value),
        dead_letter_sink=dead.describe(),
    )


def _sink_connectors(plan: Plan, dead: Any) -> list[Any]:
    found: list[Any] = []
    for node in plan.graph:
        if isinstance(node, Sink) and all(node.connector is not s for s in found):
            found.append(node.connector)
    if all(dead is not s for s in found):
        found.append(dead)
    return found


def _explain_failure(name: str, exc: Exception) -> str:
    """The useful part of a Spark failure: the Python error from the worker."""
    text = str(exc)
    marker = "StageFailure:"
    if marker in text:
        detail = text[text.index(marker) + len(marker) :].strip().splitlines()[0]
        return f"pipeline {name!r} stopped: {detail}"
    for raw in reversed(text.splitlines()):
        line = raw.strip()
        if line and ("Error" in line or "Exception" in line) and not line.startswith("at "):
            return f"pipeline {name!r} failed: {line}"
    return f"pipeline {name!r} failed: {text[:2000]}"
