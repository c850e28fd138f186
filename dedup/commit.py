"""The atomic commit: a chunk's seen-marks together with its effects.

One call of :data:`~onceflow.kernel.scripts.COMMIT` checks-and-marks the chunk's IDs, writes
the chunk's backup (:func:`onceflow.backup.store.chunk_args`), the keyed state it changed,
its Bloom journal entry, counters and the watermark, fenced by the driver epoch and the task
token. If any ID was seen meanwhile (a copy committed by another task) nothing is stored and
the conflicting IDs come back; if GC raised the floor past the task's, nothing is stored
and :class:`~onceflow.dedup.errors.HorizonMovedError` is raised.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from onceflow.backup.store import chunk_args
from onceflow.dedup.addressing import Addressing, KeyTable
from onceflow.dedup.errors import HorizonMovedError
from onceflow.dedup.session import TaskSession
from onceflow.kernel.records import InRow, Output

FLOOR_MOVED = b"floor"
CONFLICT = b"conflict"


def commit_chunk(
    session: TaskSession,
    addressing: Addressing,
    chunk: int,
    fresh: list[InRow],
    outputs: list[Output],
    updates: Mapping[str, Mapping[bytes, bytes]],
) -> tuple[Any, set[bytes]]:
    """Commit one chunk; return the new filter sequence (or 0) and the conflicting IDs.

    Raises :class:`HorizonMovedError` when GC moved the floor (the chunk must be admitted
    again with the new floor).
    """
    ks, stage, partition = session.ks, session.stage, session.partition
    keys = KeyTable(
        [
            *session.fence_keys(),
            ks.backup(stage, session.batch, partition),
            ks.filter_seq(stage, partition),
            ks.filter_journal(stage, partition),
            ks.stats(stage),
            ks.watermark,
            ks.gc_floor,
        ]
    )
    rids = [row[1] for row in fresh]
    tss = [row[2] for row in fresh]
    ids_blob, owns, alts, journal = addressing.address(stage, rids, tss, keys, session.floor, True)
    state_args: list[Any] = []
    n_state = 0
    for node, values in updates.items():
        index = keys.add(ks.state(node, partition))
        for kb, value in values.items():
            state_args += [index, kb, value]
            n_state += 1
    sent = sum(1 for o in outputs if o.target >= 0)
    session.count("committed", len(fresh))
    session.count("out", sent)
    field, blob = chunk_args(chunk, outputs)
    args = [
        *session.fence_args(),
        session.owner,
        field,
        blob,
        journal,
        max(tss, default=0),
        len(fresh),
        ids_blob,
        owns,
        alts,
        session.floor,
        n_state,
        *state_args,
        *session.stat_args(),
    ]
    reply = session.check(session.scripts.commit(keys=keys.keys, args=args))
    session.round_trip()
    if reply[0] in (FLOOR_MOVED, CONFLICT):  # nothing was stored
        session.uncount({"committed": len(fresh), "out": sent})
    if reply[0] == FLOOR_MOVED:
        session.floor = max(session.floor, int(reply[1]))
        raise HorizonMovedError(stage)
    if reply[0] == CONFLICT:
        flat = reply[1]
        conflicts = {bytes(flat[i]) for i in range(0, len(flat), 2)}
        session.count("duplicates", len(conflicts))
        return 0, conflicts
    session.pending.clear()
    return int(reply[1]), set()
