"""A transactional sink's delivery: write, prepare, remember as pending, commit.

The records become visible once, together with their delivered-marks in Redis (see
:class:`~onceflow.connectors.base.TransactionalWriter` and :mod:`onceflow.dedup.delivery`).
"""

from __future__ import annotations

from collections.abc import Callable

from onceflow.connectors.base import (
    PoisonInTransaction,
    Rejected,
    TransactionalWriter,
    TransactionBroken,
)
from onceflow.kernel.records import Output, Record
from onceflow.runtime.faults import CrashPoint
from onceflow.runtime.guard import Guard
from onceflow.runtime.task.times import timed


def accepted(todo: list[Output], records: list[Record], rejected: list[Rejected]) -> list[Output]:
    """The outputs whose records (``records[i]`` is ``todo[i]``'s) the sink did not refuse."""
    if not rejected:
        return todo
    refused = {id(rec) for rec, _ in rejected}
    return [o for o, rec in zip(todo, records, strict=True) if id(rec) not in refused]


class SinkTransaction:
    """One delivery to a transactional writer, for one sink target of one task."""

    def __init__(
        self,
        guard: Guard,
        writer: TransactionalWriter,
        index: int,
        crash: Callable[[CrashPoint], None],
        count: Callable[[str, int], None],
    ) -> None:
        self.guard = guard
        self.writer = writer
        self.index = index
        self.crash = crash
        self.count = count

    def deliver(self, todo: list[Output], records: list[Record]) -> list[Rejected]:
        """Write, prepare, remember as pending, commit: the records become visible once.

        A transaction its system broke (:class:`TransactionBroken`: Kafka went away under
        it) is recovered once Redis confirms this attempt still owns the sink partition
        (``note_writer`` is fenced: a zombie attempt stops there): the writer ends it and
        says whether it committed; if not, the records go again in a new transaction, under
        a new pending delivery.
        """
        rejected: list[Rejected] = []
        writer = self.writer
        sending = records
        while True:
            try:
                sending = self._commit(todo, records, sending, rejected)
                break
            except TransactionBroken:
                self.guard.note_writer(self.index, writer.identity)
                with timed("kafka recover"):
                    recovered = writer.recover()
                if recovered:
                    break
                self.count("sink_transactions_redone", 1)
        self.crash(CrashPoint.AFTER_SINK_COMMIT)
        return rejected

    def _commit(
        self,
        todo: list[Output],
        records: list[Record],
        sending: list[Record],
        rejected: list[Rejected],
    ) -> list[Record]:
        """One transaction of ``sending``: refused records join ``rejected``; what was sent.

        The pending delivery names what becomes visible: a recovery marks exactly that.
        Every transaction begins after a fenced ``note_writer`` of this attempt: the first
        (see :mod:`~.sink_delivery`), one after a poison abort (here) or a recovery (``deliver``).
        """
        writer = self.writer
        while True:
            with timed("kafka write"):
                refused = writer.write(sending)
            rejected += refused
            if refused:  # refused before sending: not again in a redone transaction
                sending = _without(sending, refused)
            self.crash(CrashPoint.IN_SINK_TRANSACTION)
            try:
                with timed("kafka prepare"):
                    marker = writer.prepare()
                break
            except PoisonInTransaction as poison:  # the transaction was aborted: again without
                rejected += poison.rejected
                sending = _without(sending, poison.rejected)
                # the next transaction begins only once Redis confirms this attempt still
                # owns the partition, with its writer recorded (as before the first one)
                self.guard.note_writer(self.index, writer.identity)
        with timed("redis pending"):
            self.guard.prepare_delivery(self.index, marker, accepted(todo, records, rejected))
        self.crash(CrashPoint.AFTER_SINK_WRITE)
        with timed("kafka commit"):
            writer.commit()
        return sending


def _without(records: list[Record], rejected: list[Rejected]) -> list[Record]:
    """``records`` less the rejected ones (by identity: two records may be equal)."""
    bad = {id(rec) for rec, _ in rejected}
    return [r for r in records if id(r) not in bad]
