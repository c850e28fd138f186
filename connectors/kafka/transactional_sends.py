"""The records of an open Kafka transaction: queued until one fails, refusals told apart.

A transactional producer refuses every send after one record failed, until the transaction
is aborted: the first failure is kept (:attr:`TransactionalSends.failed`) and the
transaction's :meth:`~.transactional_writer.TransactionalKafkaWriter.prepare` finds it
broken. A record batch the broker refused may hold one culprit among innocent records (see
:func:`~.writer.culprits`): its records become suspects, each sent in a request of its own
in the next transaction, so that the broker's refusal names the culprit for certain.
"""

from __future__ import annotations

from collections.abc import Sequence

from onceflow.connectors.base import Rejected, TaskInfo
from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.kafka.clients import KafkaUnavailable, RecordRefused
from onceflow.connectors.kafka.serialization import RECORD_OVERHEAD_BYTES
from onceflow.connectors.kafka.writer import KafkaWriter, WritingSink
from onceflow.kernel.records import Record


class TransactionalSends(KafkaWriter):
    """Sends a task's records in the open transaction and finds the ones the broker refuses.

    The transactional writer (:mod:`.transactional_writer`) builds its commit protocol on
    this: it opens the transaction before :meth:`_queue` and settles what was sent when it
    prepares, and gives it its :attr:`producer` (the partition's transactional one). Records
    acknowledged with the time of writing count as restamped only once the transaction
    commits (:attr:`restamping` until then).
    """

    def __init__(self, sink: WritingSink, task: TaskInfo) -> None:
        # Not KafkaWriter's: that one takes the process's shared producer.
        self.sink = sink
        self.keyed = task.keyed
        self.limit = sink.max_request_size - RECORD_OVERHEAD_BYTES
        self.sent = []
        self.stamped = set()
        self.restamped = 0
        self.restamping = 0  # acknowledged in the open transaction: final once it commits
        self.outage = None
        # the first send refused synchronously in this transaction: after a record fails, a
        # transactional producer refuses every later send until the transaction is aborted
        self.failed: Exception | None = None
        # records (by id()) of a batch the broker refused, to send on their own next time
        self.suspects: set[int] = set()

    def _queue(self, records: Sequence[Record]) -> list[Rejected]:
        """Queue records in the open transaction, suspects each on its own; those refused."""
        if self.failed is not None:
            return []  # prepare() finds the transaction broken, and it is redone
        rejected = self._send_all([r for r in records if id(r) not in self.suspects])
        return rejected + self._write_alone([r for r in records if id(r) in self.suspects])

    def _send_all(self, records: Sequence[Record]) -> list[Rejected]:
        """Queue records until one fails other than for good (then the transaction is broken)."""
        rejected: list[Rejected] = []
        for rec in records:
            if self.failed is not None:
                break
            try:
                self._send(rec)
            except RecordRefused as exc:
                rejected.append((rec, str(exc)))
            except Exception as exc:  # noqa: BLE001 - the transaction cannot commit: prepare() says so
                self.failed = exc
        return rejected

    def _write_alone(self, records: list[Record]) -> list[Rejected]:
        """Send each record in a request of its own, until the broker refuses one.

        The refused one is then the only refusal ``prepare`` finds: certainly poison.
        One the broker took is no longer a suspect: the next transaction sends it with the
        others, so each suspect goes alone once (and each culprit costs one transaction).
        """
        rejected: list[Rejected] = []
        for rec in records:
            if self.failed is not None or self._await_answers():
                self.failed = self.failed or KafkaUnavailable("records were not acknowledged")
                break
            rejected += self._send_all([rec])
            if self._await_answers():
                self.failed = KafkaUnavailable("a record sent alone was not acknowledged")
                break
            sent = self.sent[-1][1] if self.sent and self.sent[-1][0] is rec else None
            if sent is None or not sent.done:
                continue
            if sent.failure is not None:
                self.failed = ConnectorError(sent.failure)
            else:
                self.suspects.discard(id(rec))
        return rejected

    def _written_restamped(self, n: int) -> None:
        self.restamping += n
