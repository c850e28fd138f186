"""A transactional sink's delivery: write, prepare, remember as pending, commit.

The records become visible once, together with their delivered-marks in Redis (see
:class:`~onceflow.connectors.base.TransactionalWriter` and :mod:`onceflow.dedup.delivery`).
Each transaction carries its :class:`~onceflow.connectors.base.DeliveryMark` into the sink;
when the sink already holds a committed delivery of that number that Redis lost (see
:mod:`~.sink_delivery`), the transaction is not committed: it is counted delivered if its
records are those, else the run stops (:class:`LostDeliveryError`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from onceflow.connectors.base import (
    DeliveryMark,
    PoisonInTransaction,
    Rejected,
    TransactionalWriter,
    TransactionBroken,
)
from onceflow.kernel.records import Output, Record
from onceflow.runtime.errors import LostDeliveryError
from onceflow.runtime.faults import CrashPoint
from onceflow.runtime.guard import Guard
from onceflow.runtime.task.times import timed


def outputs_digest(outputs: list[Output]) -> str:
    """A digest of sink records as delivered (IDs, keys and values, in order)."""
    digest = hashlib.blake2b(digest_size=16)
    for o in outputs:
        key = o.key or b""
        digest.update(b"%d:%d:%d:" % (len(o.id), len(key), len(o.value)))
        digest.update(o.id)
        digest.update(key)
        digest.update(o.value)
    return digest.hexdigest()


def accepted(todo: list[Output], records: list[Record], rejected: list[Rejected]) -> list[Output]:
    """The outputs whose records (``records[i]`` is ``todo[i]``'s) the sink did not refuse."""
    if not rejected:
        return todo
    refused = {id(rec) for rec, _ in rejected}
    return [o for o, rec in zip(todo, records, strict=True) if id(rec) not in refused]


class SinkTransaction:
    """One delivery to a transactional writer, for one sink target of one task.

    ``lost``: committed deliveries of the sink partition in this micro-batch that Redis has
    no record of (oldest first, see :mod:`~.sink_delivery`); a delivery matched with the first
    is taken off it. ``where``: the sink's name and the micro-batch.
    """

    def __init__(
        self,
        guard: Guard,
        writer: TransactionalWriter,
        index: int,
        crash: Callable[[CrashPoint], None],
        count: Callable[[str, int], None],
        lost: list[DeliveryMark] | None = None,
        where: tuple[str, int] = ("", 0),
    ) -> None:
        self.guard = guard
        self.writer = writer
        self.index = index
        self.crash = crash
        self.count = count
        self.lost = lost if lost is not None else []
        self.sink, self.batch = where
        self.marker = ""  # the committed transaction's marker ("" if it was one Redis lost)

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
        Every transaction begins after :meth:`_begins`: the first, one after a poison abort
        or after a recovery (``deliver``).
        """
        writer = self.writer
        while True:
            self._begins()
            with timed("kafka write"):
                refused = writer.write(sending)
            rejected += refused
            if refused:  # refused before sending: not again in a redone transaction
                sending = _without(sending, refused)
            self.crash(CrashPoint.IN_SINK_TRANSACTION)
            mark = self._mark(accepted(todo, records, rejected))
            try:
                with timed("kafka prepare"):
                    marker = writer.prepare(mark)
                break
            except PoisonInTransaction as poison:  # the transaction was aborted: again without
                rejected += poison.rejected
                sending = _without(sending, poison.rejected)
        if self.lost:
            self._instead_of_lost(mark)
            return sending
        with timed("redis pending"):
            self.guard.prepare_delivery(
                self.index, marker, accepted(todo, records, rejected), not writer.keeps_marks
            )
        self.crash(CrashPoint.AFTER_SINK_WRITE)
        with timed("kafka commit"):
            writer.commit()
        self.marker = marker
        return sending

    def _begins(self) -> None:
        """Before a transaction begins: the writer ready, then recorded in Redis (fenced).

        The writer registers what it needs first (:meth:`TransactionalWriter.ready`), then
        Redis confirms that this attempt still owns the sink partition and records the
        writer's identity; nothing registers after that until the transaction is over. So a
        retry that took the partition over after the record settles this identity for good:
        this attempt's transaction then fails (its producer fenced) instead of staying open
        under a registration nobody settles (``read_committed`` readers would wait for it
        until Kafka's transaction timeout, were the attempt to die).
        """
        with timed("sink ready"):
            self.writer.ready()
        with timed("redis note writer"):
            self.guard.note_writer(self.index, self.writer.identity)

    def _mark(self, outputs: list[Output]) -> DeliveryMark | None:
        """This delivery's mark: its number in the micro-batch, and its records' digest.

        The digest is made when Redis may lose the delivery's record after the sink
        committed it (``lossy``), or when a delivery Redis lost must be told apart.
        """
        guard = self.guard
        if not guard.incarnation:  # not an exactly-once streaming run
            return None
        digest = outputs_digest(outputs) if guard.lossy or self.lost else ""
        seq = guard.logged_deliveries(self.index)
        return DeliveryMark(guard.incarnation, self.batch, seq, digest)

    def _instead_of_lost(self, mark: DeliveryMark | None) -> None:
        """The sink committed this delivery before Redis lost it: match it, or stop.

        Counted delivered (this transaction aborted) only if it is the same delivery:
        same number, same records, byte for byte. Anything else would write records a reader
        already has, or others in their place.
        """
        lost = self.lost[0]
        self.writer.abort()
        if mark is None or not lost.digest or (mark.seq, mark.digest) != (lost.seq, lost.digest):
            raise LostDeliveryError(lost_delivery_message(self.sink, lost, len(self.lost)))
        self.lost.pop(0)
        self.count("deliveries_found_in_sink", 1)


def lost_deliveries(
    writer: TransactionalWriter, guard: Guard, index: int, batch: int, last: str | None
) -> list[DeliveryMark]:
    """The sink's committed deliveries of micro-batch ``batch`` that Redis has no record of.

    Redis logged the sink partition's deliveries of the micro-batch in order, numbered from
    0; the sink's marks numbered past what Redis logged are deliveries it lost (see
    :mod:`~.sink_delivery`). ``last``: the partition's last delivery Redis knows.
    """
    with timed("sink marks"):
        marks = writer.delivered_in(batch, guard.incarnation, last)
    known = guard.logged_deliveries(index)
    return [m for m in marks or () if m.seq >= known]


def lost_delivery_message(sink: str, lost: DeliveryMark, n: int) -> str:
    """Why a run stops on a delivery the sink committed and Redis lost, and what to do."""
    more = f" (and {n - 1} after it)" if n > 1 else ""
    return (
        f"sink {sink!r} committed delivery {lost.seq} of micro-batch {lost.batch}{more} (its "
        "marker is in the sink), but Redis has no record of it: Redis lost acknowledged "
        "writes (its host crashed before they were fsynced, which --allow-unconfirmed-fsync "
        "accepts, or it went back another way), and the records this run would deliver in "
        "its place are not those. "
        "Writing them would put copies or other values beside what readers already read, so "
        "the run stops; what the sink holds is exact up to that delivery. Start the pipeline "
        "over (onceflow reset, and new output topics), and run on a Redis that confirms its "
        "fsync (appendfsync always, or Redis 7.2+) so that this cannot happen again"
    )


def _without(records: list[Record], rejected: list[Rejected]) -> list[Record]:
    """``records`` less the rejected ones (by identity: two records may be equal)."""
    bad = {id(rec) for rec, _ in rejected}
    return [r for r in records if id(r) not in bad]
