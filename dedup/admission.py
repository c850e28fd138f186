"""Admission: which records of a chunk are new.

Records whose event time is older than the dedup floor are *late* (a copy could no longer be
recognised), and records further ahead of the micro-batch's time than the pipeline allows are
*ahead* (a wrong clock, or seconds where milliseconds were meant): both become dead letters,
and neither moves the watermark. Copies within the chunk or the task are decided at once. For
the rest the receiver's Bloom filters, across every live generation, say "no" (new) or
"maybe"; only the maybes are settled by one Redis lookup per chunk, which asks every live
generation, so a copy is recognised whatever timestamp it carries.

Positional IDs (a record's position in a source every replay of a micro-batch reads alike,
see :class:`~onceflow.kernel.records.Record`) need neither: such an ID can only come back in
an attempt of the task that read it, so it is decided at once by the task's backup alone,
and is committed without a seen-mark (:attr:`Admission.unmarked`). This is Beam's
``UnboundedSource.requiresDeduping()`` being false for a Kafka reader: the offsets in the
checkpoint, not a record-ID memory, keep a source from being read twice.

A source record whose ID was seen with *other content* (its fingerprint, a checksum of the
key and value bytes read, differs from the one the seen-mark holds) is no copy: an upstream
app copied one ID header onto several records, or an id function names an entity rather than
an event. It is an *ID conflict* (:attr:`Admission.conflicts`), refused as a dead letter rather
than dropped as a copy; a copy carries its original's bytes.

A record an earlier attempt of this very task already committed is *replayed*: its effect
(its key counts as touched) is not applied again. Its ID is among the inputs the task's
backup says earlier attempts committed (``earlier``, see :mod:`onceflow.backup.format`),
decided at once, before any filter or lookup, so every seen-mark Redis finds is a copy's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import itemgetter

from onceflow.dedup.addressing import MAX_SCRIPT_KEYS, Addressing, KeyTable
from onceflow.dedup.config import MAX_CHUNK
from onceflow.dedup.session import TaskSession
from onceflow.dedup.trust import Receiver
from onceflow.kernel.records import InRow
from onceflow.kernel.script_args import lookup_args
from onceflow.kernel.seen_layout import same_content

FRESH, REPLAY, DUP, LATE, AHEAD, CONFLICT = "fresh", "replay", "dup", "late", "ahead", "conflict"
_LOOKUP_SPARE_KEYS = 16
_ID, _TS = itemgetter(1), itemgetter(2)


@dataclass
class Admission:
    """What admission decided for a chunk."""

    fresh: list[InRow]
    replayed: list[InRow] = field(default_factory=list)  # committed by an earlier attempt
    unmarked: set[bytes] = field(default_factory=set)  # fresh positional IDs: no seen-mark
    duplicates: int = 0
    late: list[InRow] = field(default_factory=list)  # older than the dedup horizon
    ahead: list[InRow] = field(default_factory=list)  # further ahead of the clock than allowed
    conflicts: list[InRow] = field(default_factory=list)  # seen ID, other content
    fingerprints: dict[bytes, int] = field(default_factory=dict)  # fresh ID -> content fingerprint


def admit(
    session: TaskSession,
    rx: Receiver,
    addressing: Addressing,
    admitted: dict[bytes, int],
    rows: list[InRow],
    earlier: frozenset[bytes] = frozenset(),
    positional: Sequence[bool] = (),
    fingerprints: Sequence[int] = (),
) -> tuple[Admission, dict[str, int]]:
    """Decide every row of a chunk; return the admission and what to count for it.

    ``admitted``: IDs this attempt committed, with their fingerprints; ``earlier``: those
    earlier attempts of the task committed, by its backup;
    ``positional``: per row, whether its ID is positional (empty: none is); ``fingerprints``: per
    row, its content fingerprint (empty, or 0: unknown).
    """
    fps = fingerprints or [0] * len(rows)
    decision, candidates = _triage(session, admitted, earlier, rows, positional, fps)
    maybes = maybe(session, rx, [rows[i][1] for i in candidates])
    asks = [i for i, m in zip(candidates, maybes, strict=True) if m]
    for i, m in zip(candidates, maybes, strict=True):
        if not m:
            decision[i] = FRESH
    if asks:
        values = lookup(session, addressing, rx.name, [rows[i][1] for i in asks])
        for i, value in zip(asks, values, strict=True):
            decision[i] = _settle(value, fps[i])
    adm = _split(rows, decision)
    if fingerprints:
        adm.fingerprints = {
            row[1]: fp for row, d, fp in zip(rows, decision, fps, strict=True) if d == FRESH
        }
    if positional:
        adm.unmarked = {
            row[1] for row, d, p in zip(rows, decision, positional, strict=True) if p and d == FRESH
        }
    counts = {
        "in": len(rows),
        "bloom_maybe": len(asks),
        "duplicates": adm.duplicates,
        "late": len(adm.late),
        "ahead": len(adm.ahead),
        "id_conflicts": len(adm.conflicts),
    }
    for name, n in counts.items():
        session.count(name, n)
    return adm, counts


def _triage(
    session: TaskSession,
    admitted: dict[bytes, int],
    earlier: frozenset[bytes],
    rows: list[InRow],
    positional: Sequence[bool],
    fingerprints: Sequence[int],
) -> tuple[list[str], list[int]]:
    """Decide at once what needs no filter; the rest are candidates.

    Late, ahead, copies (or ID conflicts) within the task, earlier attempts' inputs and
    positional IDs.
    """
    found = _plain_triage(session, admitted, earlier, rows, positional)
    if found is not None:
        return found
    return _triage_each(session, admitted, earlier, rows, positional, fingerprints)


def _triage_each(
    session: TaskSession,
    admitted: dict[bytes, int],
    earlier: frozenset[bytes],
    rows: list[InRow],
    positional: Sequence[bool],
    fingerprints: Sequence[int],
) -> tuple[list[str], list[int]]:
    """:func:`_triage` row by row."""
    bucket_ms = session.config.bucket_ms
    floor = session.floor
    limit = session.limit_ms
    decision = [""] * len(rows)
    candidates: list[int] = []
    in_chunk: dict[bytes, int] = {}
    by_position = positional or [False] * len(rows)
    for i, row in enumerate(rows):
        rid, ts = row[1], row[2]
        if ts // bucket_ms < floor:
            decision[i] = LATE
        elif limit is not None and ts > limit:
            decision[i] = AHEAD
        elif by_position[i]:  # read once per task: only an earlier attempt can have it
            decision[i] = REPLAY if rid in earlier else FRESH
        elif rid in in_chunk or rid in admitted:
            held = in_chunk[rid] if rid in in_chunk else admitted[rid]
            decision[i] = (
                DUP if not held or not fingerprints[i] or held == fingerprints[i] else CONFLICT
            )
        elif rid in earlier:
            decision[i] = REPLAY
            in_chunk[rid] = 0
        else:
            in_chunk[rid] = fingerprints[i]
            candidates.append(i)
    return decision, candidates


def _plain_triage(
    session: TaskSession,
    admitted: dict[bytes, int],
    earlier: frozenset[bytes],
    rows: list[InRow],
    positional: Sequence[bool],
) -> tuple[list[str], list[int]] | None:
    """:func:`_triage` of a chunk with nothing unusual, decided for all rows at once.

    Nothing unusual: no row late or ahead, and either every ID positional, or none and no ID
    twice in the chunk or known to the task (admitted, or an earlier attempt's). Otherwise
    None: the rows are decided one by one.
    """
    n = len(rows)
    if not n or not _in_time(session, rows):
        return None if n else ([], [])
    rids = list(map(_ID, rows))
    if positional and positional.count(True) == n:  # read once per task: only earlier ones
        if earlier.isdisjoint(rids):
            return [FRESH] * n, []
        return [REPLAY if rid in earlier else FRESH for rid in rids], []
    plain = not any(positional) and len(set(rids)) == n
    if plain and earlier.isdisjoint(rids) and admitted.keys().isdisjoint(rids):
        return [""] * n, list(range(n))
    return None


def _in_time(session: TaskSession, rows: list[InRow]) -> bool:
    """Whether no row is late (``ts // bucket < floor``) or ahead of the limit."""
    times = list(map(_TS, rows))
    limit = session.limit_ms
    return min(times) >= session.floor * session.config.bucket_ms and (
        limit is None or max(times) <= limit
    )


def _settle(value: bytes | None, fingerprint: int) -> str:
    """What a Redis answer means: unseen, a copy, or an ID conflict.

    An earlier attempt's inputs never get here: the backup named them first.
    """
    if value is None:
        return FRESH
    return DUP if same_content(value, fingerprint) else CONFLICT


def _split(rows: list[InRow], decision: list[str]) -> Admission:
    fresh = decision.count(FRESH)
    if fresh == len(rows):
        return Admission(rows)
    if fresh + decision.count(REPLAY) == len(rows):
        return Admission(
            [row for row, d in zip(rows, decision, strict=True) if d == FRESH],
            [row for row, d in zip(rows, decision, strict=True) if d == REPLAY],
        )
    adm = Admission([])
    for row, d in zip(rows, decision, strict=True):
        if d == FRESH:
            adm.fresh.append(row)
        elif d == REPLAY:
            adm.replayed.append(row)
        elif d == DUP:
            adm.duplicates += 1
        elif d == LATE:
            adm.late.append(row)
        elif d == CONFLICT:
            adm.conflicts.append(row)
        else:
            adm.ahead.append(row)
    return adm


def maybe(session: TaskSession, rx: Receiver, ids: Sequence[bytes]) -> list[bool]:
    """Bloom answers across live generations, adding the IDs; all "maybe" if not trusted."""
    if not ids:
        return []
    answers = rx.filters.check_and_add(ids, session.generation, session.live_generations)
    return answers if rx.trusted else [True] * len(ids)


def lookup(
    session: TaskSession, addressing: Addressing, receiver: str, ids: Sequence[bytes]
) -> list[bytes | None]:
    """Seen value of each ID in any live generation of the authoritative store (None: unseen).

    The value is :data:`~onceflow.kernel.seen_layout.SEEN_MARK` or a source record's content
    fingerprint (:func:`~onceflow.kernel.seen_layout.fingerprint_value`).

    One script call per slice of IDs small enough that its KEYS (a shard per generation per
    ID at most) stay within the script's index range, and never more than
    :data:`~onceflow.dedup.config.MAX_CHUNK` IDs (a task's end-of-task outputs may be many).
    """
    generations = session.live_generations
    per_call = min(MAX_CHUNK, (MAX_SCRIPT_KEYS - _LOOKUP_SPARE_KEYS) // len(generations))
    values: list[bytes | None] = []
    for start in range(0, len(ids), per_call):
        part = ids[start : start + per_call]
        keys = KeyTable()
        blob, index = addressing.lookup(receiver, part, generations, keys)
        args = lookup_args(len(part), len(generations), blob, index)
        reply = session.store.script("lookup", keys.keys, args)
        session.round_trip()
        values.extend(v if v else None for v in reply)
    session.count("redis_lookups", len(ids))
    return values
