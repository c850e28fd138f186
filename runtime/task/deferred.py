"""Executor side: a micro-batch's delivery job, when its sinks deliver after one durable wait.

With ``appendfsync everysec`` Redis confirms a write's fsync (``WAITAOF``) only at its next
periodic fsync, up to a second later. A task that waited before each delivery paid that per
delivery, one stage after another (measured: ~4 s per micro-batch of the README pipeline on
Redis 8). So such a batch runs in two Spark jobs (a group commit):

1. the stages run; each task commits its chunks and holds its sink outputs, which its backup
   has already (:class:`~.sink_delivery.SinkDelivery` in ``deferred`` mode), and says that it
   did (:func:`~onceflow.runtime.metrics.deferred_counter`);
2. the driver waits once until Redis says every write of the batch is durable (the end of
   batch wait, :func:`onceflow.dedup.durability.wait_durable`);
3. this job: one task per stage partition that held sink outputs reads them back from its
   backup (claiming the partition, so an older attempt of it is fenced) and delivers them.

A delivery of step 3 rests on writes that can no longer be lost. Its own record in Redis (the
pending delivery, then the delivered-log) is not waited for when its sink keeps the
delivery's mark (``TransactionalWriter.keeps_marks``): a host crash that loses it makes the
batch run again, and its delivery task finds the delivery in the sink. The records it would
deliver in its place are read from the same durable backup and split into deliveries the
same way, so they are the same records byte for byte: the delivery is counted delivered, never
written twice (see :mod:`~.sink_delivery`). A sink that keeps no marks (a plain sink) still
waits for its record's durability before each delivery.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from onceflow.dedup.errors import FencedError
from onceflow.kernel.records import Output, TaskRef
from onceflow.runtime.errors import TASK_FAILURE_MARK, RuntimeFailure, TaskFailure
from onceflow.runtime.faults import CrashPoint, crashpoint
from onceflow.runtime.guard import GuardFactory
from onceflow.runtime.ops.body import StageBody
from onceflow.runtime.spec import StageSpec
from onceflow.runtime.task import times as task_times
from onceflow.runtime.task.sink_delivery import SinkDelivery

MAX_FAILURE_CHARS = 600
DELIVERY_TIMES = "delivery-job-"  # the timed steps of a delivery task, beside the stage's


class DeferredDeliveries:
    """The function of a micro-batch's delivery job: each element is ``(stage, partition)``.

    Yields one count per element delivered (the job's action counts them).
    """

    def __init__(
        self, specs: Mapping[str, StageSpec], guards: GuardFactory, batch: int, metrics: Any
    ) -> None:
        self.specs = dict(specs)
        self.guards = guards
        self.batch = batch
        self.metrics = metrics

    def __call__(self, items: Iterable[tuple[str, int]]) -> Iterator[int]:
        """Deliver what each stage partition's backup holds for its sinks."""
        from pyspark import TaskContext

        ctx = TaskContext.get()
        attempt = ctx.attemptNumber() if ctx is not None else 0
        attempt_id = ctx.taskAttemptId() if ctx is not None else 0
        for stage, partition in items:
            spec = self.specs[stage]
            ref = TaskRef(stage, self.batch, partition, attempt, spec.sinks, attempt_id)
            counters = deliver_backed_up(spec, self.guards, ref)
            if self.metrics is not None:
                self.metrics.add(counters)
            yield 1


def deliver_backed_up(spec: StageSpec, guards: GuardFactory, task: TaskRef) -> dict[str, int]:
    """Deliver the sink outputs task ``task``'s backup holds; return its counters.

    The guard claims the stage partition for this attempt and reads its backup, without the
    stage's Bloom filters (nothing is admitted here).
    """
    counters: dict[str, int] = {}

    def count(name: str, n: int = 1) -> None:
        key = f"{spec.name}/{name}"
        counters[key] = counters.get(key, 0) + n

    def crash(point: CrashPoint) -> None:
        crashpoint(point, spec.name, task.batch, task.partition, task.attempt)

    times = task_times.begin()
    guard = guards(task)
    body = StageBody(spec, guard.mode, task.batch, task.partition)
    sinks = SinkDelivery(spec, guard, body, task, count, crash, defer=False)
    ok = False
    try:
        with task_times.timed("redis open"):
            backup = guard.open_sinks()
        held = _sink_outputs(spec, backup.outputs)
        rows = sinks.hold(held) + sinks.deliver_held(list(sinks.held)) + sinks.flush()
        if rows:
            msg = f"stage {spec.name!r}: a delivery job made rows for Spark; this is a bug"
            raise RuntimeFailure(msg)
        ok = True
    except FencedError:
        raise
    except Exception as exc:
        where = f"stage {spec.name!r} (batch {task.batch}, partition {task.partition})"
        text = " ".join(str(exc).split())[:MAX_FAILURE_CHARS]
        line = f"{TASK_FAILURE_MARK} {where}: {type(exc).__name__}: {text}"
        raise TaskFailure(line) from exc
    finally:
        sinks.close(ok)
        for name, n in guard.close().items():
            count(name, n)
        if times is not None:  # apart from the stage's own tasks: see bench/latency.py
            for name, n in times.counters().items():
                count(f"{DELIVERY_TIMES}{name}", n)
            task_times.end()
    return counters


def _sink_outputs(spec: StageSpec, outputs: list[Output]) -> dict[int, list[Output]]:
    """The outputs of the stage's sink targets, by target, in backup order."""
    by_target: dict[int, list[Output]] = {}
    for out in outputs:
        if out.target >= 0 and not spec.targets[out.target].is_row:
            by_target.setdefault(out.target, []).append(out)
    return by_target
