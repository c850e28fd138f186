"""Driver side of a micro-batch's delivery job: the sinks deliver after one durable wait.

See :mod:`onceflow.runtime.task.deferred` for why and what the job's tasks do. The batch's
stage tasks name the stage partitions that left sink outputs to it
(:func:`~onceflow.runtime.metrics.deferred_counter`, in the run's counters); after the end
of batch wait the driver takes those names out of the counters and runs one task per
partition, as one Spark job.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from onceflow.runtime.metrics import take_deferred
from onceflow.runtime.task.deferred import DeferredDeliveries

if TYPE_CHECKING:
    from onceflow.runtime.driver.run_context import RunContext


def run_delivery_job(ctx: RunContext, guards: Any, batch_id: int) -> int:
    """Deliver what the batch's tasks left to its delivery job; return how many partitions.

    ``guards``: the batch's guard factory (its parameters, what it waits for).
    """
    work, rest = take_deferred(dict(ctx.metrics.value))
    if not work:
        return 0
    ctx.metrics.value = rest
    stages = {stage for stage, _ in work}
    specs = {spec.name: spec for spec in ctx.job.stages if spec.name in stages}
    deliver = DeferredDeliveries(specs, guards, batch_id, ctx.metrics)
    context = ctx.spark.sparkContext
    group = f"onceflow-deliveries-{batch_id}"
    context.setJobGroup(group, f"{ctx.job.pipeline} micro-batch {batch_id}: deliveries")
    context.parallelize(work, len(work)).mapPartitions(deliver).count()
    return len(work)
