"""Admission: which records of a chunk are new.

Records older than the dedup floor are *late* (a copy could no longer be recognised: they
become dead letters). Copies within the chunk or the task are decided at once. For the rest
the receiver's Bloom filter of the record's time bucket says "no" (new) or "maybe"; only the
maybes are settled by one Redis lookup per chunk. A "maybe" whose owner is this very task
(``batch.partition``) is a record an earlier attempt already committed: its effect is
*replayed* (its key counts as touched), not applied again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from onceflow.dedup.addressing import Addressing, KeyTable
from onceflow.dedup.config import MAX_CHUNK
from onceflow.dedup.session import TaskSession
from onceflow.dedup.trust import Receiver
from onceflow.kernel.records import InRow

FRESH, REPLAY, DUP, LATE = "fresh", "replay", "dup", "late"


@dataclass
class Admission:
    """What admission decided for a chunk."""

    fresh: list[InRow]
    replayed: list[InRow] = field(default_factory=list)  # committed by an earlier attempt
    duplicates: int = 0
    late: list[InRow] = field(default_factory=list)  # older than the dedup horizon


def admit(
    session: TaskSession,
    rx: Receiver,
    addressing: Addressing,
    admitted: set[bytes],
    rows: list[InRow],
) -> tuple[Admission, dict[str, int]]:
    """Decide every row of a chunk; return the admission and what to count for it."""
    decision, candidates = _triage(session, admitted, rows)
    maybes = maybe(session, rx, addressing, [(rows[i][1], rows[i][2]) for i in candidates])
    asks = [i for i, m in zip(candidates, maybes, strict=True) if m]
    for i, m in zip(candidates, maybes, strict=True):
        if not m:
            decision[i] = FRESH
    if asks:
        owners = lookup(session, addressing, rx.name, [(rows[i][1], rows[i][2]) for i in asks])
        for i, owner in zip(asks, owners, strict=True):
            decision[i] = _settle(session, owner)
    adm = _split(rows, decision)
    counts = {
        "in": len(rows),
        "bloom_maybe": len(asks),
        "duplicates": adm.duplicates,
        "late": len(adm.late),
    }
    for name, n in counts.items():
        session.count(name, n)
    return adm, counts


def _triage(
    session: TaskSession, admitted: set[bytes], rows: list[InRow]
) -> tuple[list[str], list[int]]:
    """Late records and in-task copies are decided at once; the rest are candidates."""
    bucket_ms = session.config.bucket_ms
    floor = session.floor
    decision = [""] * len(rows)
    candidates: list[int] = []
    in_chunk: set[bytes] = set()
    for i, row in enumerate(rows):
        rid = row[1]
        if row[2] // bucket_ms < floor:
            decision[i] = LATE
        elif rid in in_chunk or rid in admitted:
            decision[i] = DUP
        else:
            in_chunk.add(rid)
            candidates.append(i)
    return decision, candidates


def _settle(session: TaskSession, owner: bytes | None) -> str:
    """What a Redis answer means: unseen, committed by an earlier attempt, or a copy."""
    if owner is None:
        return FRESH
    return REPLAY if owner == session.owner else DUP


def _split(rows: list[InRow], decision: list[str]) -> Admission:
    adm = Admission([])
    for row, d in zip(rows, decision, strict=True):
        if d == FRESH:
            adm.fresh.append(row)
        elif d == REPLAY:
            adm.replayed.append(row)
        elif d == DUP:
            adm.duplicates += 1
        else:
            adm.late.append(row)
    return adm


def maybe(
    session: TaskSession,
    rx: Receiver,
    addressing: Addressing,
    items: Sequence[tuple[bytes, int]],
) -> list[bool]:
    """Bloom answers for ``(id, ts)`` pairs, adding them; all "maybe" if not trusted."""
    if not items:
        return []
    bucket_ms = session.config.bucket_ms
    answers = rx.filters.check_and_add(
        [rid for rid, _ in items],
        [ts // bucket_ms for _, ts in items],
        [addressing.neighbour(ts, session.floor) for _, ts in items],
    )
    return answers if rx.trusted else [True] * len(items)


def lookup(
    session: TaskSession, addressing: Addressing, receiver: str, items: Sequence[tuple[bytes, int]]
) -> list[bytes | None]:
    """Owner of each ``(id, ts)`` in the authoritative store (None when unseen).

    One script call per :data:`~onceflow.dedup.config.MAX_CHUNK` items, so a task's
    end-of-task outputs (one per key of a large combine) never make one giant call.
    """
    owners: list[bytes | None] = []
    for start in range(0, len(items), MAX_CHUNK):
        part = items[start : start + MAX_CHUNK]
        keys = KeyTable()
        args = addressing.lookup_args(receiver, part, keys, session.floor)
        reply = session.scripts.lookup(keys=keys.keys, args=args)
        session.round_trip()
        owners.extend(o if o else None for o in reply)
    session.count("redis_lookups", len(items))
    return owners
