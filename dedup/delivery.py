"""Delivery to sinks: skip what an earlier attempt delivered, mark what the sink acknowledged.

A sink record can only be delivered by the task whose commit backed it up: its ID derives
from an input that one task committed, once. So only another attempt of that task (a retry,
or the micro-batch replayed) can deliver it again. So each delivery that became visible is
logged in that task's backup (:func:`log_delivered`); an attempt reads the log when it opens
(with the backup it already reads) and skips what it lists: no Bloom filter, no seen-ID and
no Redis call per record. The log goes with the backup, once Spark has committed the
micro-batch. A sink's counters and pending delivery are kept under ``<sink>/delivered``
(:func:`receiver_name`).

In between, the sink partition keeps one *pending* delivery in Redis (:func:`prepare`):

* a transactional sink records the marker of its open transaction before committing it; a
  crash before the log is resolved by the next attempt, which asks the sink whether that
  transaction committed (:func:`resolve_logged`: committed, log the IDs; aborted, send
  again), so nothing is written twice;
* a plain sink records the IDs it is about to write; a crash before the log means those
  may have reached the sink and will be written again: the next attempt counts them as
  ``possible_copies`` (``onceflow status`` shows them), with the same ID and value.

A transactional writer's identity (a Kafka transactional id, one per sink partition and
worker lease, reused by the partition's tasks in that worker) is recorded in the same hash
before it begins each transaction for the partition (:func:`note_writer`, fenced: an attempt
that no longer owns the partition cannot record, nor begin); logging the delivery deletes
the hash, and with it the record. An attempt that opens the partition reads both
(:func:`sink_state`) and settles every identity it finds (of any worker lease) before it asks
whether a pending delivery happened: then no transaction of a crashed or zombie attempt is
left open (blocking ``read_committed`` readers until it times out), and none can still commit
after the answer.

Logging a transactional delivery keeps its marker in the hash as the partition's ``last``:
when Redis lost the records of later deliveries (a host crash with its fsync unconfirmed, or
a delivery made without waiting for its pending record, see ``onceflow.runtime.task.
deferred``), the sink's own marks tell which deliveries it committed, read from there on
(``onceflow.runtime.task.sink_delivery``). :class:`TaskDeliveries` is the guard's side of all
this: what the task's backup says was delivered, and how many deliveries it logged.
"""

from __future__ import annotations

from dataclasses import dataclass

from onceflow.backup.format import DELIVERIES, TaskBackup, delivered_field_parts
from onceflow.dedup.durability import check_wait, check_waitaof
from onceflow.dedup.session import TaskSession
from onceflow.kernel import script_args
from onceflow.kernel.ids import split_ids
from onceflow.kernel.records import Output

DELIVERED = "/delivered"
NO_MARKER = "-"  # a plain (not transactional) delivery: it cannot tell whether it happened


WRITER_FIELD = "writer:"  # + a transactional writer's identity, in the pending hash


@dataclass(frozen=True)
class PendingDelivery:
    """A delivery a sink partition made (or began) and did not mark.

    ``batch``: the micro-batch that made it (None when an Onceflow that did not record it
    did).
    """

    marker: str
    ids: list[bytes]
    batch: int | None = None

    @property
    def transactional(self) -> bool:
        """Whether the sink can tell if it happened."""
        return self.marker != NO_MARKER


@dataclass(frozen=True)
class SinkState:
    """What an earlier attempt left for a sink partition: its pending delivery, and writers.

    ``writers``: identities of transactional writers that may hold a transaction open for it;
    ``last``: the marker of the partition's last transactional delivery logged (None: none).
    """

    pending: PendingDelivery | None = None
    writers: tuple[str, ...] = ()
    last: str | None = None


def receiver_name(sink: str) -> str:
    """Redis name of a sink's counters and pending delivery (stage names never contain '/')."""
    return sink + DELIVERED


def sink_state(session: TaskSession, name: str) -> SinkState:
    """The sink partition's pending delivery and recorded writers (see the module docstring).

    ``name``: the sink's receiver name (:func:`receiver_name`).
    """
    fields = session.store.hgetall(session.ks.pending(name, session.partition))
    session.round_trip()
    writers = tuple(
        f.decode()[len(WRITER_FIELD) :] for f in fields if f.startswith(WRITER_FIELD.encode())
    )
    marker, blob, batch = fields.get(b"marker"), fields.get(b"ids"), fields.get(b"batch")
    last = fields[b"last"].decode() if b"last" in fields else None
    if marker is None:
        return SinkState(None, writers, last)
    ids = split_ids(blob or b"", "a pending delivery's IDs")
    made_by = int(batch) if batch is not None else None
    return SinkState(PendingDelivery(marker.decode(), ids, made_by), writers, last)


def note_writer(session: TaskSession, name: str, identity: str, begins: bool = True) -> None:
    """Record a transactional writer before it begins a transaction (``begins=False``: forget).

    Forget it only when its transaction was aborted before any of it could become visible.
    """
    keys, args = script_args.note_writer(
        session.fence, session.ks.pending(name, session.partition), WRITER_FIELD + identity, begins
    )
    session.check(session.store.script("note_writer", keys, args))
    session.round_trip()


def prepare(
    session: TaskSession,
    name: str,
    marker: str,
    ids: list[bytes],
    replicas: int = 0,
    timeout_ms: int = 10_000,
    waitaof: bool = False,
) -> None:
    """Remember a delivery about to become visible (see the module docstring).

    The pending delivery must be durable before the sink makes it visible: a Redis that lost
    it (a host crash before the AOF's fsync: ``waitaof``; a failover to a replica that lacked
    it: ``replicas``) would forget a delivery that happened, and send it again. It is written
    after the backup it delivers and the batch's parameters, so their durability comes with it.
    """
    keys, args = script_args.prepare_delivery(
        session.fence,
        session.ks.pending(name, session.partition),
        marker,
        b"".join(ids),
        session.batch,
    )
    if not replicas and not waitaof:
        session.check(session.store.script("prepare_delivery", keys, args))
        session.round_trip()
        return
    cmds = session.store.batch()  # one connection: the write, then waits
    cmds.script("prepare_delivery", keys, args)
    if waitaof:
        cmds.waitaof(timeout_ms)
    if replicas:
        cmds.wait(replicas, timeout_ms)
    replies = cmds.execute()
    session.check(replies[0])
    session.round_trip()
    what = f"the pending delivery of {name} partition {session.partition}"
    if waitaof:
        check_waitaof(replies[1], what, timeout_ms)
    if replicas:
        check_wait(replies[-1], replicas, what, timeout_ms)


def log_delivered(
    session: TaskSession,
    sink: str,
    ids: list[bytes],
    end_pending: bool = True,
    copies: int = 0,
    batch: int | None = None,
    marker: str = "",
) -> None:
    """Log a delivery that became visible in the backup of the task that made it.

    The delivering task is this one unless ``batch`` names another micro-batch (a pending
    delivery an earlier batch's attempt left: its backup, if GC left it, gets the log).
    Ends the pending delivery (``end_pending``) and counts ``copies`` possible copies; a
    transactional delivery's ``marker`` stays as the partition's last (:class:`SinkState`).
    """
    name = receiver_name(sink)
    made_by = session.batch if batch is None else batch
    prefix, suffix = delivered_field_parts(sink)
    keys, args = script_args.log_delivery(
        session.fence,
        backup=session.ks.backup(session.stage, made_by, session.partition),
        stats=session.ks.stats(name),
        pending=session.ks.pending(name, session.partition),
        counter=DELIVERIES,
        field=(prefix, suffix),
        ids=b"".join(ids),
        n=len(ids),
        end_pending=end_pending,
        copies=copies,
        marker=marker,
    )
    session.check(session.store.script("log_delivery", keys, args))
    session.round_trip()
    session.count_local("delivered", len(ids))  # the script counts it in Redis
    if copies:
        session.count_local("possible_copies", copies)


def resolve_logged(
    session: TaskSession, sink: str, left: PendingDelivery, committed: bool
) -> list[bytes]:
    """End a pending delivery an earlier attempt left: log it if it happened, else drop it.

    A plain delivery's IDs may or may not have reached the sink; they will be written again,
    so they are counted as possible copies.

    Returns the IDs now known delivered (none if it did not happen).
    """
    copies = 0 if left.transactional else len(left.ids)
    ids = left.ids if committed else []
    marker = left.marker if committed and left.transactional else ""
    log_delivered(session, sink, ids, True, copies, left.batch, marker)
    session.count_local("deliveries_recovered", 1)
    return ids


class TaskDeliveries:
    """The sink side of a task's exactly-once guard, over :class:`TaskSession` and the backup.

    What the task's backup says earlier attempts delivered (``delivered_ids``, and how many
    deliveries they logged, ``logged``), per sink output; the guard fills them when it opens.
    """

    session: TaskSession
    sink_names: dict[int, str]  # output index -> sink name
    delivered_ids: dict[int, set[bytes]]
    logged: dict[int, int]
    replicas: int
    wait_timeout_ms: int
    waitaof: bool
    deferred: bool
    batch: int
    unconfirmed: bool  # writes of this attempt no wait covered (see the guard's confirm_outputs)

    def note_deliveries(self, replay: TaskBackup) -> None:
        """What the task's backup says earlier attempts delivered, per sink output."""
        by_name = {name: index for index, name in self.sink_names.items()}
        self.delivered_ids = {
            by_name[sink]: ids for sink, ids in replay.delivered.items() if sink in by_name
        }
        self.logged = {by_name[s]: n for s, n in replay.deliveries.items() if s in by_name}

    def undelivered(self, target: int, outputs: list[Output]) -> list[Output]:
        """Sink records no attempt has delivered yet (the backup's delivery log says)."""
        done = self.delivered_ids.get(target)
        return [o for o in outputs if o.id not in done] if done else outputs

    def delivered(self, target: int, outputs: list[Output], marker: str = "") -> None:
        """Log sink records delivered (their write is visible) and end the pending delivery.

        ``marker``: a transactional delivery's, kept as the sink partition's last.
        """
        ids = [o.id for o in outputs]
        log_delivered(self.session, self.sink_names[target], ids, marker=marker)
        self.delivered_ids.setdefault(target, set()).update(ids)  # a later delivery skips them
        if ids:
            self.logged[target] = self.logged.get(target, 0) + 1

    def logged_deliveries(self, target: int) -> int:
        """Deliveries of sink output ``target`` logged in this task's backup so far."""
        return self.logged.get(target, 0)

    def _receiver_name(self, target: int) -> str:
        return receiver_name(self.sink_names[target])

    def sink_state(self, target: int) -> SinkState:
        """What earlier attempts left for this sink partition: a delivery, writers to settle."""
        return sink_state(self.session, self._receiver_name(target))

    def note_writer(self, target: int, identity: str, begins: bool = True) -> None:
        """Record a transactional writer before it begins (``begins=False``: forget it)."""
        note_writer(self.session, self._receiver_name(target), identity, begins)

    def prepare_delivery(
        self, target: int, marker: str, outputs: list[Output], durable: bool = True
    ) -> None:
        """Remember a delivery about to become visible (``marker``: ``NO_MARKER`` if plain).

        ``durable`` False: the sink keeps the delivery's mark itself, so the record need not
        be durable before it commits (the batch's writes it rests on already are: deferred).
        """
        wait = durable or not self.deferred
        prepare(
            self.session,
            self._receiver_name(target),
            marker,
            [o.id for o in outputs],
            self.replicas if wait else 0,
            self.wait_timeout_ms,
            self.waitaof and wait,
        )
        if wait and (self.replicas or self.waitaof):  # its wait covered every write before it
            self.unconfirmed = False

    def resolve_pending(self, target: int, left: PendingDelivery, committed: bool) -> None:
        """End a pending delivery: log its IDs if it happened, else drop it."""
        ids = resolve_logged(self.session, self.sink_names[target], left, committed)
        self.delivered_ids.setdefault(target, set()).update(ids)
        if ids and left.batch in (None, self.batch):
            self.logged[target] = self.logged.get(target, 0) + 1
