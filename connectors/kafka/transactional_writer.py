"""The transactional Kafka writer: the commit protocol of an exactly-once Kafka sink.

Each sink partition's records go out in Kafka transactions under the transactional id of
the partition and of the worker process's lease on its machine
(``<prefix>.<sink>.<partition>.<lease>``, :mod:`.leases`; :mod:`.transactional_producers`
registers it, which fences older producers of that id), each with a marker record in the
pipeline's delivery log (:mod:`.delivery_log`).
The runtime records the delivery as pending in Redis with the marker's place before
committing, and marks the records delivered after; a crash in between is resolved by the next
attempt from the marker. Sending the records and telling apart those the broker refuses is
:mod:`.transactional_sends`'s part.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from onceflow.connectors.base import (
    DeliveryMark,
    PoisonInTransaction,
    Rejected,
    TaskInfo,
    TransactionalWriter,
    TransactionBroken,
)
from onceflow.connectors.kafka.clients import (
    Delivery,
    KafkaUnavailable,
    Producer,
    ProducerBroken,
)
from onceflow.connectors.kafka.delivery_log import (
    delivered_marks,
    delivery_id,
    marker_committed,
    marker_text,
    marker_value,
    took,
)
from onceflow.connectors.kafka.leases import worker_lease
from onceflow.connectors.kafka.outage import Wait, describe
from onceflow.connectors.kafka.transactional_producers import (
    TransactionalProducer,
    transactional_id,
)
from onceflow.connectors.kafka.transactional_sends import TransactionalSends
from onceflow.connectors.kafka.writer import FLUSH_SLICE_S, WritingSink
from onceflow.kernel.records import Record

COMMIT_TIMEOUT_S = 20.0  # a commit not answered by then is settled by registering anew


class TransactionalKafkaWriter(TransactionalSends, TransactionalWriter):
    """Writes a task's records in Kafka transactions (see the module docstring).

    Its transactional id is the sink partition's under this worker process's lease
    (:func:`transactional_id`, :mod:`.leases`); this process registers it once and its later
    tasks of the partition reuse the producer (:class:`TransactionalProducer`). The runtime
    records the id in Redis before each transaction begins (fenced: an attempt that no
    longer owns the partition stops there), and a later attempt of the partition settles
    every id it finds recorded (:meth:`settle`), whichever lease or machine it names: so a
    zombie's transaction under another lease's id is ended before the new attempt reads its
    marker or writes. A producer some other registration fenced (a retry settled this lease's
    id, or a process on another machine has the same lease number) is replaced without a word: its
    transaction fails, and the runtime has it :meth:`recover`.

    **A Kafka that goes away** under an open transaction (its producer's sends or commit
    fail, or it stops making progress) ends that producer's use: :meth:`prepare` and
    :meth:`commit` wait (see :mod:`.outage`), then raise :class:`TransactionBroken`; the
    runtime checks in Redis that its attempt still owns the partition and calls
    :meth:`recover`, which registers the id anew (ending the transaction: a commit that
    reached the coordinator completes, anything else is aborted, so nothing of it can still
    change) and reads the prepared marker: committed, the delivery happened; else the
    runtime writes the records again in a new transaction, under a new pending delivery.
    """

    keeps_marks = True

    def __init__(self, sink: WritingSink, task: TaskInfo) -> None:
        super().__init__(sink, task)
        self.task = task
        prefix = sink.transaction_prefix
        self.tid = transactional_id(prefix, task.sink, task.partition, worker_lease(str(prefix)))
        # the delivery log keeps each sink partition's newest marker (compacted by key)
        self.log_key = transactional_id(prefix, task.sink, task.partition).encode()
        self.txn = TransactionalProducer(sink, self.tid, self._waiting)
        self.marker: str | None = None  # the marker prepare() returned for the open transaction
        self.deliveries = 0

    @property
    def identity(self) -> str:
        """The transactional id: the sink partition's, under this process's lease."""
        return self.tid

    @property
    def producer(self) -> Producer:  # type: ignore[override]
        """This process's registered producer of the id (registered when first needed)."""
        return self.txn.producer

    def _renew(self) -> None:
        """Register the id anew (see :meth:`TransactionalProducer.renew`)."""
        self.txn.renew()

    def _waiting(self) -> Wait:
        if self.outage is None:
            doing = f"writing to Kafka topic {self.sink.topic!r} in transaction {self.tid!r}"
            self.outage = Wait(self.sink.settings, doing)
        return self.outage

    def settle(self, identities: Sequence[str]) -> None:
        """End the transactions these ids may hold open, by registering each anew.

        Every id recorded for the partition, this process's own included (its last writer
        may be this process's producer or another's) and those of other leases. Registering
        fences only producers of that id, so of this partition.
        """
        self.txn.settle(identities)

    def ready(self) -> None:
        """Register the id if this process has no producer of it fit for a transaction."""
        self.txn.ready()

    def _begin(self) -> None:
        """Begin a transaction unless one is open; a producer that cannot begin breaks it."""
        try:
            began = self.txn.begin()
        except (ProducerBroken, KafkaUnavailable) as exc:
            msg = f"the transaction could not begin: {describe(exc)}"
            raise self._broken(msg) from exc
        if began:
            self.marker = None

    # -- the commit protocol -----------------------------------------------------------------

    def write(self, records: Sequence[Record]) -> list[Rejected]:
        """Queue the records in the open transaction (begun if none is); those refused at once."""
        self._begin()
        return self._queue(records)

    def _poisoned(self, refused: list[Rejected]) -> PoisonInTransaction:
        """The broker refused records: abort, and name them if it is certain which are poison.

        When it is not (see :func:`~.writer.culprits`), none is named and they are sent on
        their own in the next transaction (see :mod:`.transactional_sends`).
        """
        self._abort_and_renew()
        if len(refused) == 1:  # certain (see culprits); the rest is sent again
            return PoisonInTransaction(refused)
        self.suspects.update(id(rec) for rec, _ in refused)
        return PoisonInTransaction([])

    def _abort_and_renew(self) -> None:
        """Abort, then register the id afresh.

        After the broker refused a record, neither client's producer is fit for the next
        transaction (measured: kafka-python's is left in the middle of an epoch bump,
        librdkafka's sequence numbers skip and its next commit fails). The transaction was
        aborted with its marker unsent or refused: nothing of it can become visible.
        """
        self.abort()
        self.txn.renew()

    def prepare(self, mark: DeliveryMark | None = None) -> str:
        """Send the marker, flush, and return ``log topic|partition|offset|delivery id``.

        The marker record holds ``mark`` too (see :mod:`.delivery_log`). Records the broker
        refused abort the transaction (:class:`PoisonInTransaction`, see :meth:`_poisoned`).
        A transaction Kafka did not take otherwise raises :class:`TransactionBroken` (see the
        class docstring).
        """
        assert self.sink.log_topic is not None
        self._begin()
        delivery = delivery_id(self.task, self.deliveries)
        self.deliveries += 1
        marker = self._send_marker(delivery, mark)
        stuck = self._await_answers(*([marker] if marker is not None else []))
        refused, failed = self._outcomes()
        stopped, self.failed = self.failed, None
        if refused and not stuck:
            raise self._poisoned(refused)
        if stuck or stopped is not None or failed or not took(marker):
            why = describe(stopped) if stopped is not None else None
            why = why or (failed[0][1] if failed else "the delivery marker was not written")
            msg = f"Kafka did not take the transaction's records: {why}"
            raise self._broken(msg)
        self.suspects.clear()
        assert marker is not None
        self.marker = marker_text(marker, marker_value(delivery, mark).decode())
        return self.marker

    def _send_marker(self, delivery: str, mark: DeliveryMark | None) -> Delivery | None:
        """Queue the delivery marker, unless a record failed before (then the transaction did)."""
        assert self.sink.log_topic is not None  # prepare() checked it
        if self.failed is not None:
            return None
        self.txn.prepared = True
        try:
            value = marker_value(delivery, mark)
            return self.producer.send(self.sink.log_topic, self.log_key, value, None, None)
        except Exception as exc:  # noqa: BLE001 - a record failed before: settled by prepare()
            self.failed = exc
            return None

    def _broken(self, why: str) -> TransactionBroken:
        """The open transaction cannot commit: wait a little for Kafka, then say so.

        The producer is not used again: :meth:`recover` registers a new one, whose
        registration ends the transaction; until then it stays recorded for the partition
        (not aborted cleanly), so that an attempt after a crash settles it. Past the outage
        bound this raises :class:`KafkaUnavailable` instead: the run stops.
        """
        self.txn.abandon()
        self._waiting().failed(KafkaUnavailable(why))
        return TransactionBroken(why)

    def commit(self) -> None:
        """Commit; a commit Kafka does not answer within :data:`COMMIT_TIMEOUT_S` is broken.

        The wait says so every 10 s (see :mod:`.outage`); a broken commit's fate is learnt
        by :meth:`recover`.
        """
        deadline = time.monotonic() + COMMIT_TIMEOUT_S
        while True:
            try:
                self.txn.commit(FLUSH_SLICE_S)
                break
            except KafkaUnavailable as exc:
                if time.monotonic() < deadline:
                    self._waiting().note(f"the commit is not answered yet: {describe(exc)}")
                    continue
                msg = f"the commit was not answered: {describe(exc)}"
                raise self._broken(msg) from exc
            except ProducerBroken as exc:
                msg = f"the commit failed: {describe(exc)}"
                raise self._broken(msg) from exc
        self.restamped += self.restamping
        self.restamping = 0
        self.outage = None  # Kafka answered: a later outage is waited for from its start

    def recover(self) -> bool:
        """End the broken transaction (registering the id anew); whether its marker committed.

        Waits for Kafka as long as the outage bound allows, registering and then reading the
        marker :meth:`prepare` returned, if it returned one. Records stamped with the time of
        writing in it count as restamped only if it committed.
        """
        marker, self.marker = self.marker, None
        self.txn.discard()
        self.txn.renew()
        done = marker is not None and self.committed(marker)
        if done:
            self.restamped += self.restamping
        self.restamping = 0
        return done

    def committed(self, marker: str) -> bool:
        """Read the marker (call once every id recorded for the partition is settled)."""
        return marker_committed(self.sink.settings, marker, self.sink.client)

    def delivered_in(
        self, batch: int, incarnation: str, since: str | None
    ) -> list[DeliveryMark] | None:
        """The marks of the partition's committed markers of ``batch`` in the delivery log."""
        assert self.sink.log_topic is not None
        return delivered_marks(
            self.sink.settings, self.sink.log_topic, self.log_key, since, batch, incarnation
        )

    def counts(self) -> dict[str, int]:
        """``restamped`` (see the plain writer), and ``registrations`` of the id by this writer.

        A registration in a task means the partition's id was last registered by another
        process (or never in this one): its cost is a visible part of a micro-batch's time.
        """
        counts = super().counts()
        if self.txn.registrations:
            counts["registrations"] = self.txn.registrations
        return counts

    def flush(self) -> list[Rejected]:
        """Transactional records are settled by :meth:`prepare`; nothing to do here."""
        return []

    def close(self) -> None:
        """Abort the open transaction, if any: what was not committed by now never is."""
        self.abort()

    def abort(self) -> None:
        """Forget what was sent and abort the open transaction, if any."""
        self.sent = []
        self.stamped = set()
        self.restamping = 0
        self.failed = None
        if self.txn.open:
            self.txn.abort_open()

    def aborted_cleanly(self) -> bool:
        """Whether the abort went through before any marker was sent (see the base class)."""
        return self.txn.aborted_cleanly()
