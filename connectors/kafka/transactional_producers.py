"""Transactional producers: one per transactional id a worker process writes, registered once.

A sink partition's writers in one worker process share one transactional id,
``<prefix>.<sink>.<partition>.<lease>`` (:func:`transactional_id`), where ``lease`` is the
process's lease number on this machine (:mod:`.leases`). A worker process registers the id once
and reuses the producer for that partition's later tasks there (:data:`_TXN_PRODUCERS`),
unless another process of the machine registered the id since (:mod:`.registrations`: a
retry settling what a failed attempt of the partition left, or a process that took the lease
number of a dead one); :class:`TransactionalProducer` is one writer's hold on it.

Registering an id fences every older producer of that id, wherever it runs, and ends its
open transaction (a commit under way completes, anything else is aborted). Producers of one
partition under two leases do not fence each other: the runtime records each writer's id in
Redis before its transaction begins and a later attempt of the partition registers every id
recorded for it anew (:meth:`TransactionalProducer.settle`), see :mod:`onceflow.dedup.delivery`.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from onceflow.connectors.kafka.clients import (
    Producer,
    ProducerBroken,
    new_producer,
)
from onceflow.connectors.kafka.outage import ATTEMPT_S, Wait, retrying, transient
from onceflow.connectors.kafka.registrations import note_registered, registered_elsewhere
from onceflow.connectors.kafka.writer import ABORT_TIMEOUT_S, WritingSink

REGISTER_TIMEOUT_S = ATTEMPT_S  # one attempt at registering a transactional id
MAX_TXN_PRODUCERS = 64


def transactional_id(
    prefix: str | None, sink: str, partition: int, lease: int | None = None
) -> str:
    """A transactional id of a sink partition's writers: ``<prefix>.<sink>.<partition>.<lease>``.

    One per (pipeline, sink, stage partition, worker lease): each worker process of a machine
    has its own (see :mod:`.leases`), so a partition's task that lands in another worker than
    last time finds that worker's producer registered already. Kafka keeps each id's state
    for ``transactional.id.expiration.ms`` after its last use: a pipeline's ids number at
    most its sink partitions times the lease numbers in use at once. Without ``lease``: the
    partition's id of older Onceflows, still the key of its markers in the delivery log.
    """
    partition_id = f"{prefix}.{sink}.{partition}"
    return partition_id if lease is None else f"{partition_id}.{lease}"


@dataclass
class _Registered:
    """A registered transactional producer, and whether a transaction of it is open."""

    producer: Producer
    open: bool = False
    token: str | None = None  # this registration's note (see .registrations)


# This worker process's transactional producers, by transactional id (one per sink partition
# it wrote, under its lease): registered once, then reused by that partition's later tasks here.
# Bounded: the least recently used one without an open transaction is closed beyond the limit.
_TXN_PRODUCERS: OrderedDict[str, _Registered] = OrderedDict()
_TXN_PID = [os.getpid()]  # a forked child starts with none of its parent's producers


def _cached(tid: str) -> _Registered | None:
    """This process's registered producer of ``tid``, if it has one."""
    if _TXN_PID[0] != os.getpid():
        _TXN_PRODUCERS.clear()
        _TXN_PID[0] = os.getpid()
    entry = _TXN_PRODUCERS.get(tid)
    if entry is not None:
        _TXN_PRODUCERS.move_to_end(tid)
    return entry


def _register(sink: WritingSink, tid: str) -> _Registered:
    """A new producer of ``tid``, registered with Kafka (kept as this process's for ``tid``).

    Registering fences every older producer of ``tid`` and ends its open transaction (a
    commit under way is completed, anything else aborted).
    """
    _drop(tid)
    producer = new_producer(
        sink.client, sink.settings, {**sink.producer_config(tid), **sink.user_options}
    )
    try:
        producer.init_transactions(REGISTER_TIMEOUT_S)
    except BaseException:
        with contextlib.suppress(Exception):
            producer.close(timeout_s=0)
        raise
    _cached(tid)  # the cache belongs to this process
    token = note_registered(sink.settings.bootstrap_servers, tid)
    entry = _TXN_PRODUCERS[tid] = _Registered(producer, token=token)
    _evict()
    return entry


def _evict() -> None:
    """Close the least recently used producers beyond :data:`MAX_TXN_PRODUCERS` (none open)."""
    idle = [tid for tid, entry in _TXN_PRODUCERS.items() if not entry.open]
    for tid in idle[: max(0, len(_TXN_PRODUCERS) - MAX_TXN_PRODUCERS)]:
        _drop(tid, timeout_s=1)


def _drop(tid: str, timeout_s: float = 0) -> None:
    """Forget (and close) this process's producer of ``tid``, if any.

    At once by default: a producer dropped because it broke may wait for ever otherwise.
    """
    entry = _TXN_PRODUCERS.pop(tid, None)
    if entry is not None:
        with contextlib.suppress(Exception):
            entry.producer.close(timeout_s=timeout_s)


def fence(sink: WritingSink, tid: str) -> None:
    """End whatever transaction ``tid`` holds open, wherever its producer runs."""
    retrying(
        sink.settings,
        f"registering transactional id {tid!r}",
        lambda: _register(sink, tid),
        is_transient=lambda exc: transient(exc) or isinstance(exc, ProducerBroken),
    )
    _drop(tid)


class TransactionalProducer:
    """One writer's hold on this process's producer of a transactional id, and its transaction.

    The producer is registered when first needed, or taken over from an earlier task of the
    partition in this process (its transaction, if left open, aborted first); one that broke
    is discarded and the id registered anew, which ends its transaction wherever it runs.
    ``prepared``: a delivery marker was sent in the open transaction; ``clean``: the last
    abort went through (see :meth:`~onceflow.connectors.base.TransactionalWriter.aborted_cleanly`).
    """

    def __init__(self, sink: WritingSink, tid: str, waiting: Callable[[], Wait]) -> None:
        self.sink = sink
        self.tid = tid
        self._waiting = waiting  # the writer's wait for Kafka under way
        self.entry: _Registered | None = None
        self.prepared = False
        self.clean = True
        self.registrations = 0  # of the id by this writer (see bench/latency.py --phases)

    @property
    def open(self) -> bool:
        """Whether a transaction of this writer's producer is open."""
        return self.entry is not None and self.entry.open

    @property
    def producer(self) -> Producer:
        """This process's registered producer of the id (registered when first needed)."""
        if self.entry is None:
            entry = _cached(self.tid)
            if entry is not None and not entry.open and self._moved(entry):
                _drop(self.tid)  # fenced by that registration: register anew, before sending
                entry = None
            if entry is None:
                self.renew()
            elif entry.open:  # an earlier task of this process left it open: end it first
                self.entry = entry
                self.abort_open()
                if self.entry is None:
                    self.renew()
            else:
                self.entry = entry
        assert self.entry is not None
        return self.entry.producer

    def _moved(self, entry: _Registered) -> bool:
        """Whether another process here registered the id since ``entry`` (see .registrations)."""
        return registered_elsewhere(self.sink.settings.bootstrap_servers, self.tid, entry.token)

    def renew(self) -> None:
        """Register the id anew (waiting out Kafka): this process's producer of it is new.

        Ends the id's open transaction wherever its producer runs (see :func:`_register`).
        """
        self.entry = None
        while self.entry is None:
            try:
                self.entry = _register(self.sink, self.tid)
                self.registrations += 1
            except Exception as exc:
                if not (transient(exc) or isinstance(exc, ProducerBroken)):
                    raise
                self._waiting().failed(exc)
        self.prepared = False

    def settle(self, identities: Sequence[str]) -> None:
        """End the transactions these ids may hold open, by registering each anew.

        Every id recorded for the partition: this process's own (registered anew, kept) and
        those of other leases, machines or an older Onceflow (registered here, then closed;
        the process that held one learns so from the note :mod:`.registrations` keeps, or
        from Kafka).
        """
        for tid in dict.fromkeys(identities):
            if tid == self.tid:
                self.renew()
            else:
                fence(self.sink, tid)

    def ready(self) -> None:
        """Hold a registered producer of the id with no transaction open (see :attr:`producer`).

        Registers the id when this process has none of it, or another process here registered
        it since (settling a failure of ours): only here, before the runtime's fenced record
        of the writer, never in :meth:`begin` (see ``TransactionalWriter.ready``).
        """
        _ = self.producer

    def begin(self) -> bool:
        """Begin a transaction, unless one is open; whether one began.

        Never registers the id once :meth:`ready` has (a producer another registration fenced
        fails here or at its first send, and the transaction is broken); a writer used
        without :meth:`ready` registers on first use.
        """
        producer = self.producer
        assert self.entry is not None
        if self.entry.open:
            return False
        producer.begin()
        self.entry.open = True
        self.prepared = False
        return True

    def commit(self, timeout_s: float) -> None:
        """One attempt at committing the open transaction (the writer retries and bounds it)."""
        assert self.entry is not None
        self.entry.producer.commit(timeout_s)
        self.entry.open = False
        self.prepared = False
        self.clean = True

    def abort_open(self) -> None:
        """Abort the open transaction; a producer that cannot is dropped (registered anew)."""
        assert self.entry is not None
        try:
            self.entry.producer.abort(ABORT_TIMEOUT_S)
            self.entry.open = False
            self.clean = True
        except Exception:  # noqa: BLE001 - a fenced or broken producer: start afresh next time
            self.abandon()

    def abandon(self) -> None:
        """Stop using the producer without ending its transaction: a registration will."""
        self.discard()
        self.clean = False

    def discard(self) -> None:
        """Stop using the producer: close it, and forget it if it is the process's."""
        entry, self.entry = self.entry, None
        if entry is None:
            return
        if _TXN_PRODUCERS.get(self.tid) is entry:
            del _TXN_PRODUCERS[self.tid]
        with contextlib.suppress(Exception):
            entry.producer.close(timeout_s=0)

    def aborted_cleanly(self) -> bool:
        """Whether the last abort went through before any marker was sent."""
        return self.clean and not self.prepared
