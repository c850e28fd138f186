"""Delivering a task's sink outputs: held, written once, marked delivered.

Sink outputs are already backed up when they are held, so holding changes when they become
visible, not whether. A delivery writes only what no attempt delivered yet and marks it once
visible; a transactional sink's choreography is :mod:`~.sink_transactions`'s. Records a sink
refuses for good become dead letters.

**A delivery the sink has and Redis lost.** Redis's record of a delivery (pending, then
logged) is what tells a later attempt not to write it again. When Redis can lose
acknowledged writes after a sink committed on them (``--allow-unconfirmed-fsync``: a host
crash takes the AOF's unsynced tail; or deliveries made after the batch's one durable wait,
``deferred``), the attempt that runs the micro-batch again would write them twice. So every
transactional delivery carries a :class:`~onceflow.connectors.base.DeliveryMark` into the
sink (its number among the partition's deliveries of the micro-batch, and a digest of its
records), and an attempt that may run on a Redis that went back (``recheck``: the batch's
first attempt in this driver, or one after a Redis server change) asks the sink, before its
first delivery, which deliveries of the micro-batch it committed (``delivered_in``, read from
the sink alone). Those Redis has no record of were lost. Each delivery the attempt then makes
in their place is prepared but not committed, and compared: the same number and the same
records byte for byte (the digest) mean it *is* that delivery, so it is counted delivered and
its transaction aborted. That is exact: readers already have exactly those records. Anything
else (other records, recomputed from what Redis kept; fewer deliveries) cannot be made exact:
writing would put copies or other values beside what readers read, dropping would lose, so
the run stops with :class:`~onceflow.runtime.errors.LostDeliveryError`, one line that says so.
A sink that keeps no marks (``keeps_marks`` False) cannot be asked: its deliveries' records
stay durable in Redis before it commits, as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from onceflow.connectors.base import DeliveryMark, Rejected, TaskInfo, TransactionalWriter
from onceflow.connectors.errors import ConnectorError
from onceflow.dedup.delivery import NO_MARKER
from onceflow.kernel.limits import outputs_bytes, split_outputs
from onceflow.kernel.records import DeadLetter, Output, Record, TaskRef
from onceflow.runtime.errors import LostDeliveryError
from onceflow.runtime.faults import CrashPoint
from onceflow.runtime.guard import Guard
from onceflow.runtime.metrics import deferred_counter
from onceflow.runtime.ops.body import StageBody
from onceflow.runtime.ops.record_text import portable
from onceflow.runtime.spec import StageSpec, TargetSpec
from onceflow.runtime.task.sink_transactions import (
    SinkTransaction,
    accepted,
    lost_deliveries,
    lost_delivery_message,
)
from onceflow.runtime.task.times import timed


class SinkDelivery:
    """A task's sink targets: their held outputs and their writers (opened on first use)."""

    def __init__(
        self,
        spec: StageSpec,
        guard: Guard,
        body: StageBody,
        task: TaskRef,
        count: Callable[[str, int], None],
        crash: Callable[[CrashPoint], None],
        defer: bool | None = None,
    ) -> None:
        self.spec = spec
        self.guard = guard
        # leave the outputs (already backed up) to the batch's delivery job (runtime.task.
        # deferred); by default when the guard says the batch delivers so
        self.defer = guard.deferred if defer is None else defer
        self.deferred = False  # this task left sink outputs to the delivery job
        self.body = body
        if self.defer:
            body.delivered_elsewhere()
        self.task = task
        self.count = count
        self.crash = crash
        self.writers: dict[int, Any] = {}
        self.held: dict[int, list[Output]] = {}  # sink target -> outputs not yet delivered
        self.held_bytes: dict[int, int] = {}  # sink target -> what its held outputs weigh
        self.noted: dict[int, str] = {}  # sink target -> writer identity recorded in Redis
        # sink target -> its committed deliveries of this micro-batch Redis has no record of
        self.lost: dict[int, list[DeliveryMark]] = {}

    def hold(self, new: dict[int, list[Output]]) -> list[Output]:
        """Hold sink outputs; deliver the targets whose held outputs fill a delivery.

        Returns dead letters that leave as rows. Deferred (see :mod:`~.deferred`), the
        outputs are left to the batch's delivery job: their backup has them.
        """
        if self.defer:
            self._leave(new)
            return []
        for index, outs in new.items():
            self.held.setdefault(index, []).extend(outs)
            self.held_bytes[index] = self.held_bytes.get(index, 0) + outputs_bytes(outs)
        budget = self.guard.delivery
        full = [i for i, outs in self.held.items() if budget.full(len(outs), self.held_bytes[i])]
        return self.deliver_held(full)

    def _leave(self, new: dict[int, list[Output]]) -> None:
        """Say once that this task left sink outputs to the delivery job (its partition)."""
        if not self.deferred and any(new.values()):
            self.deferred = True
            self.count(deferred_counter(self.task.partition), 1)

    def deliver_held(self, indexes: list[int]) -> list[Output]:
        """Deliver the held outputs of these sink targets; return dead letters as rows."""
        refused: list[Output] = []
        for index in indexes:
            outs = self.held.pop(index)
            self.held_bytes.pop(index, None)
            refused += self.deliver_all(self.spec.targets[index], outs)
        return self.deliver_dead_letters(refused)

    def deliver_all(self, target: TargetSpec, outputs: list[Output]) -> list[Output]:
        """:meth:`deliver` in deliveries of at most the guard's ``delivery`` budget each."""
        refused: list[Output] = []
        for part in split_outputs(outputs, self.guard.delivery):
            refused += self.deliver(target, part)
        return refused

    def deliver(self, target: TargetSpec, outputs: list[Output]) -> list[Output]:
        """Write sink records that no attempt delivered yet; mark them once visible.

        Returns dead letters (encoded, with IDs derived from the records') for records the
        sink refused for good; a retry refuses them again and derives the same letters.
        With IDs on, the delivery is remembered as pending in Redis before it becomes
        visible (see :mod:`onceflow.dedup.delivery`); a transactional sink commits only then.
        """
        with timed("sink open"):
            writer = self.writer(target)
        if not self.guard.mode.ids:  # no IDs to tell records apart (they may be empty)
            records = self.body.sink_records(outputs, target)
            return self.refused_letters(target, writer.write(records))
        with timed("redis undelivered"):
            todo = self.guard.undelivered(target.index, _first_of_each_id(outputs))
        skipped = len(outputs) - len(todo)
        if skipped:
            self.count("already_delivered", skipped)
        if not todo:
            return []
        records = self.body.sink_records(todo, target)  # elements, not decoded (ops.made)
        marker = ""
        if isinstance(writer, TransactionalWriter):
            rejected, marker = self._in_transaction(target, writer, todo, records)
        else:
            with timed("redis pending"):
                self.guard.prepare_delivery(target.index, NO_MARKER, todo)
            with timed("kafka write"):
                rejected = writer.write(records)
                rejected += writer.flush()
            self.crash(CrashPoint.AFTER_SINK_WRITE)
        # Refused records are not marked: their dead letters are not durable yet, and a
        # retry that finds them unmarked refuses them again and makes the same letters.
        with timed("redis delivered"):
            self.guard.delivered(target.index, accepted(todo, records, rejected), marker)
        return self.refused_letters(target, rejected)

    def _in_transaction(
        self,
        target: TargetSpec,
        writer: TransactionalWriter,
        todo: list[Output],
        records: list[Record],
    ) -> tuple[list[Rejected], str]:
        """Deliver in a transaction, its writer recorded in Redis before it begins.

        Returns the records refused and the committed transaction's marker (empty when it
        was one Redis had lost: see the module docstring).
        """
        self.noted[target.index] = writer.identity  # recorded before the transaction begins
        transaction = SinkTransaction(
            self.guard,
            writer,
            target.index,
            self.crash,
            self.count,
            self.lost.get(target.index),
            (target.name, self.task.batch),
        )
        rejected = transaction.deliver(todo, records)
        self.noted.pop(target.index, None)  # guard.delivered() deletes the record
        return rejected, transaction.marker

    def refused_letters(self, target: TargetSpec, rejected: list[Rejected]) -> list[Output]:
        """Dead letters for records a sink refused."""
        if not rejected:
            return []
        self.count("refused_by_sink", len(rejected))
        for rec, reason in rejected:
            origin = f"record {rec.id.hex()} for sink {target.name}" if rec.id else target.name
            self.body.dead(
                DeadLetter(
                    rec.id, rec.ts, target.name, reason, origin, None, portable(rec.elem), "refused"
                )
            )
        return self.body.take()

    def deliver_dead_letters(self, letters: list[Output]) -> list[Output]:
        """Send dead letters made while delivering; return those that leave as rows."""
        if not letters:
            return []
        dead = self.spec.targets[self.spec.dead_target]
        if dead.is_row:
            return letters
        refused = self.deliver_all(dead, letters)
        if refused:
            msg = f"the dead-letter sink {dead.connector.describe()} refused a dead letter"
            raise ConnectorError(msg)
        return []

    def writer(self, target: TargetSpec) -> Any:
        """The task's writer for a sink target, opened on first use.

        On opening, what earlier attempts left is dealt with first: transactional writers
        recorded for the partition are settled (their open transactions ended), then a
        delivery left pending is resolved: marked if it became visible, dropped (and counted
        as possible copies, for a plain sink) if not.
        """
        writer = self.writers.get(target.index)
        if writer is None:
            task = self.task
            info = TaskInfo(
                self.spec.pipeline,
                target.name,
                task.batch,
                task.partition,
                task.attempt,
                self.guard.mode.ids,
                task.attempt_id,
                target.keyed,
            )
            writer = target.connector.open(info)
            self.writers[target.index] = writer
            left = self.guard.sink_state(target.index)
            transactional = isinstance(writer, TransactionalWriter)
            if left.writers and transactional:
                writer.settle(left.writers)
                self.count("writers_settled", len(left.writers))
            if left.pending is not None:
                happened = (
                    writer.committed(left.pending.marker)
                    if left.pending.transactional and transactional
                    else False
                )
                self.guard.resolve_pending(target.index, left.pending, happened)
                self.count("deliveries_recovered", 1)
            if transactional and self.guard.recheck:
                lost = lost_deliveries(writer, self.guard, target.index, task.batch, left.last)
                if lost:
                    self.lost[target.index] = lost
                    self.count("deliveries_lost_by_redis", len(lost))
        return writer

    def check_lost(self) -> None:
        """At the end of the task: a lost delivery no delivery of this attempt matched stops it.

        Its records are in the sink, and this attempt made no such delivery: what Redis now
        says of the micro-batch is not what readers read.
        """
        for index, lost in self.lost.items():
            if lost:
                target = self.spec.targets[index]
                raise LostDeliveryError(lost_delivery_message(target.name, lost[0], len(lost)))

    def flush(self) -> list[Output]:
        """Flush every writer (bounded runs deliver at the end of the task).

        Records refused only now (a bounded run flushes at the end) become dead letters;
        returns those that leave as rows.
        """
        letters: list[Output] = []
        for index, writer in list(self.writers.items()):
            letters += self.refused_letters(self.spec.targets[index], writer.flush())
        rows = self.deliver_dead_letters(letters)
        for writer in self.writers.values():
            writer.flush()
        self.check_lost()
        return rows

    def close(self, ok: bool) -> None:
        """Close (or, after a failure, abort) the writers; count what they did."""
        for index, writer in self.writers.items():
            if ok:
                writer.close()
                for name, n in writer.counts().items():
                    self.count(f"{name}/{self.spec.targets[index].name}", n)
            else:
                writer.abort()
                self._forget_writer(index, writer)

    def _forget_writer(self, index: int, writer: Any) -> None:
        """After a failure: forget a recorded writer whose transaction aborted cleanly.

        Then the next attempt need not settle it (registering the partition's id anew, which
        costs a round trip and fences the producer later tasks here would reuse). Best
        effort: left recorded, it is settled instead.
        """
        identity = self.noted.pop(index, None)
        if identity is None or not writer.aborted_cleanly():
            return
        with contextlib.suppress(Exception):
            self.guard.note_writer(index, identity, begins=False)


def _first_of_each_id(outputs: list[Output]) -> list[Output]:
    """Outputs without repeated IDs: one ID is one record, however many copies a task holds.

    A retry can hold two: a dead letter replayed from the backup of the attempt that died
    before delivering it, and the same letter made again from an input that was never
    admitted (an undecodable, late or ahead record).
    """
    first: dict[bytes, Output] = {}
    for o in outputs:
        first.setdefault(o.id, o)
    return outputs if len(first) == len(outputs) else list(first.values())
