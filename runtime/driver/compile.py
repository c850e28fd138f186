"""Driver side: a job becomes DataFrames, one ``mapInArrow`` per fused stage.

Between stages, rows have :data:`~onceflow.runtime.task.loop.ROW_SCHEMA`: ID, event time,
encoded key, encoded value and ``port`` (which output of the producing stage the row belongs
to). A stage reads each upstream port it needs by filtering on ``port`` and relabelling it to
its own inbound index; an exchange is ``repartition(n, "key")`` on the encoded key, which
Spark hashes in the JVM (stable across processes, unlike Python's ``hash``). Nothing converts
to RDDs (``df.rdd`` costs ~7x). One Spark action runs everything: the union of the stages
nobody else reads, plus the rows of driver-bound sinks.

A stage's partition is part of its identity: keyed state, timers, backups, the scopes of
seen-marks and sinks' transactional ids are kept per stage partition, so it must not depend on
where Spark computes the stage. Spark's task partition id does: inside a union it is the
union's index, and a stage read in two places (by several stages, or by one and by the action
for its driver-bound rows) is persisted, so it runs once per batch, in the task of whichever
reader needs a block first: at offset k in one union and |other|+k in another (every join,
co_group, interval_join, join_table or merge of two stages has that shape). Hence
(:meth:`~onceflow.runtime.task.loop.StageFunction.partition`):

* an exchange stage's partition is the task's partition id modulo the parallelism. Stages
  that follow an exchange, and stages reading only such stages, have partition counts that
  are multiples of it (*aligned*) and every union puts them first, so that is the stage's
  own index wherever it runs, and an empty partition (where timers fire) has one too;
* every other stage takes its partition from its input: the compiler adds
  ``spark_partition_id()`` below the stage (:data:`~onceflow.runtime.task.loop.PARTITION_COLUMN`),
  which Spark evaluates on the stage's own input, never on a reader's union (a
  non-deterministic expression is not pushed through a union). Its empty partitions, having
  no row to tell them, are skipped: nothing ever ran in them.

Why not the other ways out. Running each persisted stage in a Spark job of its own first costs
a job per stage and micro-batch, serialises the stage before its readers, and still recomputes
a lost cached block in a reader's task, under the reader's index; fixed offsets per producer
cannot hold once two persisted producers meet in one union; refusing a persisted stage outside
its own job turns a lost executor into a failed batch. With the partition read from the input,
a block computed again anywhere (a lost executor, a replay in another order, two executors
computing one block at once) runs under the stage's own partition: it is one more attempt of
that task, so the newer attempt fences the older (which Spark retries) and what either
committed is replayed from the task's backup, never recomputed.

A stage that reads several ports of one producer (two exchanges of one stage, fused into one
consumer) reads them in one filter, not a union of two reads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from onceflow.kernel import codec
from onceflow.runtime.errors import RuntimeFailure
from onceflow.runtime.guard import GuardFactory
from onceflow.runtime.spec import InboundSpec, Job, StageSpec
from onceflow.runtime.task.loop import (
    BATCH_ID_PROPERTY,
    BATCH_PROPERTY,
    PARTITION_COLUMN,
    ROW_SCHEMA,
    StageFunction,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


@dataclass
class CompiledBatch:
    """The DataFrames of one batch, ready to run."""

    job: Job
    frames: dict[str, DataFrame]
    action: DataFrame | None
    driver_targets: dict[tuple[int, int], Any] = field(default_factory=dict)
    persisted: list[DataFrame] = field(default_factory=list)

    def run(self) -> None:
        """Run the batch and hand driver-bound rows to their sinks."""
        try:
            if self.action is None:
                return
            rows = self.action.collect()
            if not self.driver_targets:  # every sink is written from the workers
                return
            grouped: dict[tuple[int, int], list[Any]] = {}
            for row in rows:
                grouped.setdefault((row["stage_ix"], row["port"]), []).append(row)
            for key, connector in self.driver_targets.items():
                connector.receive([_decode_row(r) for r in grouped.get(key, [])])
        finally:
            for frame in self.persisted:
                frame.unpersist()


def _decode_row(row: Any) -> Any:
    value = codec.decode(row["value"])
    if row["key"] is not None:
        return (codec.decode(row["key"]), value)
    return value


MapStage = Callable[[StageSpec, "DataFrame"], "DataFrame"]


def compile_batch(
    job: Job,
    session: SparkSession,
    sources: Mapping[str, DataFrame],
    guards: GuardFactory,
    *,
    batch: int,
    parallelism: int,
    metrics: Any = None,
) -> CompiledBatch:
    """Build the DataFrames that run ``job`` over ``sources`` (raw frames by source name)."""

    def map_stage(spec: StageSpec, source: DataFrame) -> DataFrame:
        partitions = parallelism if spec.exchange else None
        stage_fn = StageFunction(spec, guards, batch, metrics, partitions)
        return source.mapInArrow(stage_fn, ROW_SCHEMA)

    return _compile(job, sources, parallelism, map_stage)


class StreamCompiler:
    """Compiles every micro-batch of one streaming run, with each stage's function made once.

    ``mapInArrow`` pickles its function and registers it with the JVM on every call (~15 ms
    a stage, measured, most of a micro-batch's planning). Here each stage's function is made
    and registered once, without the micro-batch in it; the batch's number and guard
    parameters reach its tasks as Spark local properties of the batch's job
    (:data:`~onceflow.runtime.task.loop.BATCH_PROPERTY`), set by :meth:`compile` on the thread
    that then runs the job.
    """

    def __init__(
        self, job: Job, session: SparkSession, guards: Any, parallelism: int, metrics: Any
    ) -> None:
        from pyspark.sql.pandas.functions import pandas_udf
        from pyspark.util import PythonEvalType

        self.job = job
        self.session = session
        self.parallelism = parallelism
        self.udfs: dict[str, Any] = {}
        for spec in job.stages:  # what DataFrame.mapInArrow makes on every call
            partitions = parallelism if spec.exchange else None
            self.udfs[spec.name] = pandas_udf(  # type: ignore[call-overload]
                StageFunction(spec, guards, None, metrics, partitions),
                returnType=ROW_SCHEMA,
                functionType=PythonEvalType.SQL_MAP_ARROW_ITER_UDF,
            )
        self.applied: dict[str, Any] = {}  # stage -> its function applied to its columns

    def compile(self, sources: Mapping[str, DataFrame], guards: Any, batch: int) -> CompiledBatch:
        """The DataFrames of micro-batch ``batch`` (``guards``: its factory), ready to run."""
        context = self.session.sparkContext
        context.setLocalProperty(BATCH_ID_PROPERTY, str(batch))
        context.setLocalProperty(BATCH_PROPERTY, guards.batch_json())
        return _compile(self.job, sources, self.parallelism, self._map_stage)

    def _map_stage(self, spec: StageSpec, source: DataFrame) -> DataFrame:
        """``source.mapInArrow`` with the stage's registered function."""
        from pyspark.sql import DataFrame
        from pyspark.sql import functions as F  # noqa: N812

        applied = self.applied.get(spec.name)
        if applied is None:  # unresolved column references: they resolve in each batch's plan
            columns = [F.col(c) for c in source.columns]
            applied = self.applied[spec.name] = self.udfs[spec.name](*columns)
        jdf = source._jdf.mapInArrow(applied._jc, False, None)  # noqa: SLF001 - see class doc
        return DataFrame(jdf, self.session)


def _compile(
    job: Job, sources: Mapping[str, DataFrame], parallelism: int, map_stage: MapStage
) -> CompiledBatch:
    """The DataFrames of one batch, each stage made by ``map_stage``."""
    from pyspark.sql import functions as F  # noqa: N812

    frames: dict[str, DataFrame] = {}
    persisted: list[DataFrame] = []
    aligned = aligned_stages(job)
    row_ports = {s.name: {t.index for t in s.targets if t.is_row} for s in job.stages}
    for spec in job.stages:
        source = _input_frame(spec, sources, frames, parallelism, aligned, row_ports)
        if not spec.exchange:  # its own partition, whoever reads it (see the module doc)
            source = source.withColumn(PARTITION_COLUMN, F.spark_partition_id())
        frame = map_stage(spec, source)
        if _reads(job, spec) > 1:
            frame = frame.persist()
            persisted.append(frame)
        frames[spec.name] = frame

    parts: list[tuple[bool, int, DataFrame]] = []
    driver_targets: dict[tuple[int, int], Any] = {}
    for ix, spec in enumerate(job.stages):
        driver = [t for t in spec.targets if t.to_driver]
        for t in driver:
            driver_targets[(ix, t.index)] = t.connector
        if not job.consumers(spec.name):
            part = frames[spec.name]
        elif driver:
            part = frames[spec.name].where(F.col("port").isin([t.index for t in driver]))
        else:
            continue
        parts.append((spec.name in aligned, ix, part))
    action = None
    for _, ix, frame in sorted(parts, key=lambda p: not p[0]):  # aligned first (stable)
        # rows that come back to the driver say which stage made them
        part = frame.withColumn("stage_ix", F.lit(ix)) if driver_targets else frame
        action = part if action is None else action.unionByName(part)
    return CompiledBatch(job, frames, action, driver_targets, persisted)


def aligned_stages(job: Job) -> set[str]:
    """Stages whose partition count is a multiple of the parallelism (see the module doc)."""
    aligned: set[str] = set()
    for spec in job.stages:
        if spec.exchange or (spec.source is None and all(p in aligned for p in spec.producers)):
            aligned.add(spec.name)
    return aligned


def _reads(job: Job, spec: StageSpec) -> int:
    """How many times a batch reads a stage's output.

    Its consumers' parts of it (one per consumer, see :func:`_producer_parts`), and the action.
    """
    reads = 0
    for name in job.consumers(spec.name):
        inbound = [i for i in job.by_name[name].inbound if i.producer == spec.name]
        reads += len(_producer_parts(inbound))
    if not reads:
        return 1
    return reads + any(t.to_driver for t in spec.targets)


def _producer_parts(inbound: list[InboundSpec]) -> list[list[InboundSpec]]:
    """A consumer's inbounds from one producer, as the parts it reads that producer in.

    One part for all of them when they read distinct ports: one filter and one relabelling
    of the producer's rows. A union of one part per inbound would read the producer twice,
    and Spark runs an unpersisted stage once per read: its second run's records, already
    committed by the first under other task partitions, were dropped as copies (two keyed
    branches of one stream fused into one stage lost one branch). Only a port read twice
    needs a part of its own (the producer is then persisted: :func:`_reads`).
    """
    ports = [i.port for i in inbound]
    if len(set(ports)) == len(ports):
        return [inbound] if inbound else []
    return [[i] for i in inbound]


def _input_frame(
    spec: StageSpec,
    sources: Mapping[str, DataFrame],
    frames: Mapping[str, DataFrame],
    parallelism: int,
    aligned: set[str],
    row_ports: Mapping[str, set[int]],
) -> DataFrame:
    """A source's raw rows, or the union of the producers' ports this stage reads.

    Ports of aligned producers come first in the union (see the module docstring). A port
    is only filtered out of a producer that makes rows of other ports too, and relabelled
    only when its number differs from the inbound index: every DataFrame operation is
    analysed by Spark on the spot, a few milliseconds of each micro-batch's planning. A
    producer's ports are read in one part (:func:`_producer_parts`): read once, it runs once.
    """
    if spec.source is not None:
        try:
            return sources[spec.source]
        except KeyError:
            msg = f"no input frame for source {spec.source!r}; this is a runner bug"
            raise RuntimeFailure(msg) from None
    by_producer: dict[str, list[InboundSpec]] = {}
    for inbound in sorted(spec.inbound, key=lambda i: i.producer not in aligned):
        by_producer.setdefault(inbound.producer, []).append(inbound)
    result = None
    for producer, reads in by_producer.items():
        for group in _producer_parts(reads):
            part = _part(frames[producer], group, row_ports[producer])
            result = part if result is None else result.unionByName(part)
    if result is None:
        msg = f"stage {spec.name!r} reads nothing; this is a runner bug"
        raise RuntimeFailure(msg)
    if spec.exchange:
        result = result.repartition(parallelism, "key")
    return result


def _part(frame: DataFrame, group: list[InboundSpec], made: set[int]) -> DataFrame:
    """The producer's rows of the ``group``'s ports, each relabelled to its inbound index.

    ``made``: the ports the producer makes (no filter when the group reads them all).
    """
    from pyspark.sql import functions as F  # noqa: N812

    ports = [i.port for i in group]
    if made != set(ports):  # the producer makes other rows too
        frame = frame.where(F.col("port").isin(ports))
    moved = [i for i in group if i.port != i.index]
    if not moved:
        return frame
    if len(group) == 1:  # the filter left rows of its port only
        return frame.withColumn("port", F.lit(group[0].index).cast("int"))
    label = F.col("port")
    for i in moved:
        label = F.when(F.col("port") == i.port, F.lit(i.index)).otherwise(label)
    return frame.withColumn("port", label.cast("int"))
