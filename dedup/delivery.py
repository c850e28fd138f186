"""Delivery to sinks: skip what an earlier attempt delivered, mark what the sink acknowledged.

A sink record can only be delivered by the task whose commit backed it up: its ID derives
from an input that one task committed, once. So only another attempt of that task (a retry,
or the micro-batch replayed) can deliver it again. From seen-ID layout 3 on, each delivery that
became visible is logged in that task's backup (:func:`log_delivered`); an attempt reads the
log when it opens (with the backup it already reads) and skips what it lists: no Bloom
filter, no seen-ID and no Redis call per record. The log goes with the backup, once Spark
has committed the micro-batch.

In layouts 1 and 2 each sink a stage writes is a receiver of its own (``<sink>/delivered``)
with its own filters and seen-IDs: before writing, :func:`undelivered` drops records some
attempt already delivered; after the write is visible, :func:`mark_delivered` marks them.

In between, the sink partition keeps one *pending* delivery in Redis (:func:`prepare`):

* a transactional sink records the marker of its open transaction before committing it; a
  crash before the marks is resolved by the next attempt, which asks the sink whether that
  transaction committed (:func:`resolve`: committed, mark the IDs; aborted, send again), so
  nothing is written twice;
* a plain sink records the IDs it is about to write; a crash before the marks means those
  may have reached the sink and will be written again: the next attempt counts them as
  ``possible_copies`` (``onceflow status`` shows them), with the same ID and value.

A transactional writer's identity (a Kafka transactional id, one per sink partition, reused
by the partition's tasks) is recorded in the same hash before it begins a transaction for the
partition (:func:`note_writer`); marking the delivery deletes the hash, and with it the
record. An attempt that opens the partition reads both (:func:`sink_state`) and settles every
identity it finds before it asks whether a pending delivery happened: then no transaction of
a crashed or zombie attempt is left open (blocking ``read_committed`` readers until it times
out), and none can still commit after the answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from onceflow.backup.format import DELIVERIES, delivered_field_parts
from onceflow.dedup.addressing import Addressing, KeyTable
from onceflow.dedup.admission import lookup, maybe
from onceflow.dedup.config import MAX_CHUNK
from onceflow.dedup.durability import check_wait, check_waitaof
from onceflow.dedup.session import TaskSession
from onceflow.dedup.trust import Receiver, journal_entry
from onceflow.kernel.ids import split_ids
from onceflow.kernel.records import Output

DELIVERED = "/delivered"
NO_MARKER = "-"  # a plain (not transactional) delivery: it cannot tell whether it happened
_YES = "1"


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

    ``writers``: identities of transactional writers that may hold a transaction open for it.
    """

    pending: PendingDelivery | None = None
    writers: tuple[str, ...] = ()


def receiver_name(sink: str) -> str:
    """Redis name of a sink's delivered-set (stage names never contain '/')."""
    return sink + DELIVERED


def undelivered(
    session: TaskSession, rx: Receiver, addressing: Addressing, outputs: list[Output]
) -> list[Output]:
    """Sink records no attempt has delivered yet."""
    maybes = maybe(session, rx, [o.id for o in outputs])
    asks = [i for i, m in enumerate(maybes) if m]
    keep = [True] * len(outputs)
    if asks:
        values = lookup(session, addressing, rx.name, [outputs[i].id for i in asks])
        for i, value in zip(asks, values, strict=True):
            keep[i] = value is None
    return [o for o, k in zip(outputs, keep, strict=True) if k]


def mark_delivered(
    session: TaskSession,
    rx: Receiver,
    addressing: Addressing,
    ids: list[bytes],
    copies: int = 0,
    newest: int = 0,
) -> None:
    """Mark sink records delivered and end the pending delivery.

    One script call per :data:`MAX_CHUNK` records; the last one ends the pending delivery
    and counts ``copies`` possible copies. ``newest`` is the records' newest event time
    (unknown for a recovered delivery: the batch's newest admissible time stands in).
    """
    parts = [ids[start : start + MAX_CHUNK] for start in range(0, len(ids), MAX_CHUNK)] or [[]]
    for n, part in enumerate(parts):
        last = n == len(parts) - 1
        _mark(session, rx, addressing, part, last, copies if last else 0, newest)


def sink_state(session: TaskSession, name: str) -> SinkState:
    """The sink partition's pending delivery and recorded writers (see the module docstring).

    ``name``: the sink's receiver name (:func:`receiver_name`).
    """
    fields = session.client.hgetall(session.ks.pending(name, session.partition))
    session.round_trip()
    writers = tuple(
        f.decode()[len(WRITER_FIELD) :] for f in fields if f.startswith(WRITER_FIELD.encode())
    )
    marker, blob, batch = fields.get(b"marker"), fields.get(b"ids"), fields.get(b"batch")
    if marker is None:
        return SinkState(None, writers)
    ids = split_ids(blob or b"", "a pending delivery's IDs")
    made_by = int(batch) if batch is not None else None
    return SinkState(PendingDelivery(marker.decode(), ids, made_by), writers)


def note_writer(session: TaskSession, name: str, identity: str, begins: bool = True) -> None:
    """Record a transactional writer before it begins a transaction (``begins=False``: forget).

    Forget it only when its transaction was aborted before any of it could become visible.
    """
    keys = [*session.fence_keys(), session.ks.pending(name, session.partition)]
    args = [*session.fence_args(), WRITER_FIELD + identity, "1" if begins else "0"]
    session.check(session.scripts.note_writer(keys=keys, args=args))
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
    keys = [*session.fence_keys(), session.ks.pending(name, session.partition)]
    args = [*session.fence_args(), marker, b"".join(ids), session.batch]
    if not replicas and not waitaof:
        session.check(session.scripts.prepare_delivery(keys=keys, args=args))
        session.round_trip()
        return
    pipe = session.client.pipeline(transaction=False)  # one connection: the write, then waits
    session.scripts.prepare_delivery(keys=keys, args=args, client=pipe)
    if waitaof:
        pipe.execute_command("WAITAOF", 1, 0, timeout_ms)
    if replicas:
        pipe.execute_command("WAIT", replicas, timeout_ms)
    replies = pipe.execute()
    session.check(replies[0])
    session.round_trip()
    what = f"the pending delivery of {name} partition {session.partition}"
    if waitaof:
        check_waitaof(replies[1], what, timeout_ms)
    if replicas:
        check_wait(replies[-1], replicas, what, timeout_ms)


def resolve(
    session: TaskSession,
    rx: Receiver,
    addressing: Addressing,
    left: PendingDelivery,
    committed: bool,
) -> None:
    """End a pending delivery an earlier attempt left: mark it if it happened, else drop it.

    A plain delivery's IDs may or may not have reached the sink; they will be written again,
    so they are counted as possible copies.
    """
    copies = 0 if left.transactional else len(left.ids)
    mark_delivered(session, rx, addressing, left.ids if committed else [], copies)
    session.count_local("deliveries_recovered", 1)


def log_delivered(
    session: TaskSession,
    sink: str,
    ids: list[bytes],
    end_pending: bool = True,
    copies: int = 0,
    batch: int | None = None,
) -> None:
    """Layout 3: log a delivery that became visible in the backup of the task that made it.

    The delivering task is this one unless ``batch`` names another micro-batch (a pending
    delivery an earlier batch's attempt left: its backup, if GC left it, gets the log).
    Ends the pending delivery (``end_pending``) and counts ``copies`` possible copies.
    """
    name = receiver_name(sink)
    made_by = session.batch if batch is None else batch
    prefix, suffix = delivered_field_parts(sink)
    keys = [
        *session.fence_keys(),
        session.ks.backup(session.stage, made_by, session.partition),
        session.ks.stats(name),
        session.ks.pending(name, session.partition),
    ]
    args = [
        *session.fence_args(),
        DELIVERIES,
        prefix,
        suffix,
        b"".join(ids),
        len(ids),
        _YES if end_pending else "0",
        copies,
    ]
    session.check(session.scripts.log_delivery(keys=keys, args=args))
    session.round_trip()
    session.count_local("delivered", len(ids))  # the script counts it in Redis
    if copies:
        session.count_local("possible_copies", copies)


def resolve_logged(
    session: TaskSession, sink: str, left: PendingDelivery, committed: bool
) -> list[bytes]:
    """Layout 3's :func:`resolve`: log the pending delivery if it happened, else drop it.

    Returns the IDs now known delivered (none if it did not happen).
    """
    copies = 0 if left.transactional else len(left.ids)
    ids = left.ids if committed else []
    log_delivered(session, sink, ids, True, copies, left.batch)
    session.count_local("deliveries_recovered", 1)
    return ids


def _mark(
    session: TaskSession,
    rx: Receiver,
    addressing: Addressing,
    ids: list[bytes],
    end_pending: bool,
    copies: int,
    newest: int = 0,
) -> None:
    ks = session.ks
    keys = KeyTable(
        [
            *session.fence_keys(),
            ks.filter_seq(rx.name),
            ks.filter_journal(rx.name),
            ks.stats(rx.name),
            ks.pending(rx.name, session.partition),
            ks.generations,
        ]
    )
    fields, runs, _order = addressing.address_runs(rx.name, ids, session.generation, keys)
    journal = journal_entry(session.generation, b"".join(ids))
    args = [
        *session.fence_args(),
        session.seen_value,
        journal,
        len(ids),
        fields,
        runs,
        _YES if end_pending else "0",
        copies,
        session.generation,
        newest or session.limit_ms or 0,
    ]
    reply = session.check(session.scripts.mark_delivered(keys=keys.keys, args=args))
    session.round_trip()
    seq, again = int(reply[1]), int(reply[2])
    if seq > 0:
        # The filters may only claim this commit once they hold its IDs (a recovered
        # delivery's IDs never went through undelivered()).
        rx.filters.add(ids, session.generation)
        rx.committed(seq, session.generation)
    # The script counts these in Redis itself: the run's metrics only.
    session.count_local("delivered", len(ids) - again)
    session.count_local("delivered_again", again)
    if copies:
        session.count_local("possible_copies", copies)
