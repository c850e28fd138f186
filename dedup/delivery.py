"""Delivery to sinks: skip what an earlier attempt delivered, mark what the sink acknowledged.

Each sink a stage writes is a receiver of its own (``<sink>/delivered``) with its own filters
and seen-IDs. Before writing, :func:`undelivered` drops records some attempt already
delivered; after the sink acknowledged a write, :func:`mark_delivered` marks them. A crash
between the two can leave a copy in the sink, with the same ID and value.
"""

from __future__ import annotations

from onceflow.dedup.addressing import Addressing, KeyTable
from onceflow.dedup.admission import lookup, maybe
from onceflow.dedup.config import MAX_CHUNK
from onceflow.dedup.session import TaskSession
from onceflow.dedup.trust import Receiver
from onceflow.kernel.records import Output

DELIVERED = "/delivered"


def receiver_name(sink: str) -> str:
    """Redis name of a sink's delivered-set (stage names never contain '/')."""
    return sink + DELIVERED


def undelivered(
    session: TaskSession, rx: Receiver, addressing: Addressing, outputs: list[Output]
) -> list[Output]:
    """Sink records no attempt has delivered yet."""
    maybes = maybe(session, rx, addressing, [(o.id, o.ts) for o in outputs])
    asks = [i for i, m in enumerate(maybes) if m]
    keep = [True] * len(outputs)
    if asks:
        owners = lookup(
            session, addressing, rx.name, [(outputs[i].id, outputs[i].ts) for i in asks]
        )
        for i, owner in zip(asks, owners, strict=True):
            keep[i] = owner is None
    return [o for o, k in zip(outputs, keep, strict=True) if k]


def mark_delivered(
    session: TaskSession, rx: Receiver, addressing: Addressing, outputs: list[Output]
) -> None:
    """Mark sink records delivered, one script call per :data:`MAX_CHUNK` records."""
    for start in range(0, len(outputs), MAX_CHUNK):
        _mark(session, rx, addressing, outputs[start : start + MAX_CHUNK])


def _mark(
    session: TaskSession, rx: Receiver, addressing: Addressing, outputs: list[Output]
) -> None:
    ks, partition = session.ks, session.partition
    keys = KeyTable(
        [
            *session.fence_keys(),
            ks.filter_seq(rx.name, partition),
            ks.filter_journal(rx.name, partition),
            ks.stats(rx.name),
        ]
    )
    ids_blob, owns, _alts, journal = addressing.address(
        rx.name, [o.id for o in outputs], [o.ts for o in outputs], keys, session.floor, False
    )
    args = [*session.fence_args(), session.owner, journal, len(outputs), ids_blob, owns]
    reply = session.check(session.scripts.mark_delivered(keys=keys.keys, args=args))
    session.round_trip()
    seq, again = int(reply[1]), int(reply[2])
    if seq > 0:
        rx.filters.seq = seq
    # The script counts these in Redis itself: the run's metrics only.
    session.count_local("delivered", len(outputs) - again)
    session.count_local("delivered_again", again)
