"""What a streaming run's micro-batches share: made once at start-up, never changed after.

:func:`~.startup.start` builds a :class:`RunContext` with every field set; the
micro-batches (:mod:`~.batch_run`), the query (:mod:`~.query`) and observation
(:mod:`~.observe`) read it. What changes from batch to batch (how many ran, the servers seen)
belongs to :class:`~.batch_run.MicroBatches`, not here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from onceflow.dedup.clock import BatchClock
from onceflow.dedup.config import DedupConfig
from onceflow.dedup.durability import Durability
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.records import Guarantee
from onceflow.kernel.scopes import Connect, Scopes
from onceflow.runtime.driver.checkpoint import Checkpoint
from onceflow.runtime.driver.phases import Phases
from onceflow.runtime.driver.stopping import StopRequest
from onceflow.runtime.driver.ticks import Ticker
from onceflow.runtime.spec import Job

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


@dataclass(frozen=True)
class RunContext:
    """The state of one streaming run that its micro-batches share (see the module doc).

    ``job`` reads each source as this run does (copies: see
    :meth:`~onceflow.connectors.base.SourceConnector.for_run`); ``epoch`` is the driver's
    fencing epoch; ``metrics`` the Spark accumulator of the tasks' counters; ``steps`` where
    the start-up's time went (its last phase, the query's start, is marked after the context
    is made); ``started`` when the run began (``time.monotonic()``).
    """

    job: Job
    spark: SparkSession
    mode: Guarantee
    guards: Any  # ExactlyOnceGuards or AtLeastOnceGuards
    client: Any
    keyspace: Keyspace
    epoch: int
    parallelism: int
    metrics: Any
    progress: bool
    config: DedupConfig
    durability: Durability | None
    scopes: Scopes  # stage partitions with a hash tag of their own
    connect: Connect  # the client of a hash tag
    redis_restarts: int  # runs of a batch again after a server change
    clock: BatchClock  # where new batches' times come from (dedup.clock)
    ticker: Ticker | None
    trigger_ms: int
    stop: StopRequest
    stop_after: int | None
    checkpoint: Checkpoint
    exporter: Any  # a RunExporter when metrics are served, else None
    dead_letters: Any  # the dead-letter sink
    sinks: tuple[Any, ...]  # every sink, prepared (the dead-letter sink too)
    steps: Phases
    started: float

    def targets(self) -> list[tuple[Keyspace, Any]]:
        """Every hash tag of the pipeline with its client, the namespace's first."""
        return [(ks, self.connect(ks.tag)) for ks in self.scopes.keyspaces()]
