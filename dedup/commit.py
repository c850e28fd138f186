"""The atomic commit: a chunk's seen-marks together with its effects.

One call of :data:`~onceflow.kernel.scripts.COMMIT` checks-and-marks the chunk's IDs in the
batch's generation, writes the chunk's backup (:func:`onceflow.backup.store.chunk_args`, and
its input IDs, :func:`~onceflow.backup.store.inputs_args`), the keyed state and timers it
changed, its Bloom journal entry (full IDs, not seen fields), counters
and the newest event time of each source lane (what the watermark is computed from), fenced
by the driver epoch and the task token. If any ID was seen meanwhile (a copy committed by
another task of the same batch: the batch's tasks share one generation) nothing is stored and
the script says which of the chunk's IDs conflicted (by position in the fields it was
sent). The commit also raises the generation's newest event time, which decides how long it
is kept.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from itertools import repeat
from operator import attrgetter, itemgetter

import numpy as np

from onceflow.backup.store import chunk_args, inputs_args
from onceflow.dedup.addressing import Addressing, KeyTable
from onceflow.dedup.session import TaskSession
from onceflow.dedup.state import state_args
from onceflow.dedup.trust import journal_entry
from onceflow.kernel.records import InRow, Output, StateWrite
from onceflow.kernel.script_args import CommitKeys, SeenBlob, commit_args
from onceflow.kernel.seen_layout import same_content

CONFLICT = b"conflict"
_TS, _TARGET = itemgetter(2), attrgetter("target")
FLOOR = b"floor"


class FloorRaised(Exception):  # noqa: N818 - a signal to the task, not an error
    """GC deleted seen-IDs older than ``floor_ms`` while the batch ran: redo the chunk with it.

    Nothing of the chunk was written; records older than the floor are late in the redo.
    """

    def __init__(self, floor_ms: int) -> None:
        super().__init__(f"GC raised its floor to {floor_ms}")
        self.floor_ms = floor_ms


def commit_chunk(
    session: TaskSession,
    addressing: Addressing,
    chunk: int,
    fresh: list[InRow],
    outputs: list[Output],
    updates: Mapping[str, StateWrite],
    lanes: Mapping[str, int],
    batch_time_ms: int,
    unmarked: Collection[bytes] = frozenset(),
    fingerprints: Mapping[bytes, int] | None = None,
) -> tuple[int, set[bytes], set[bytes]]:
    """Commit one chunk; return its commit number (or 0), its conflicts and ID conflicts.

    The conflicting IDs were committed by another task meanwhile; those whose seen-mark
    holds other content are ID conflicts, not copies.
    ``lanes`` maps each source lane the chunk read to its newest admitted event time.
    ``unmarked``: IDs of ``fresh`` that take no seen-mark (positional IDs, see
    :mod:`onceflow.dedup.admission`): they are kept among the task's inputs in its backup,
    and are neither marked, journaled for the Bloom filters nor checked for conflicts.
    ``fingerprints``: content fingerprints of source records, which their seen-marks hold
    (:func:`~onceflow.kernel.seen_layout.fingerprint_value`); without, the marks hold the session's
    constant value.
    """
    ks, stage, partition = session.ks, session.stage, session.partition
    fence = session.fence
    keys = KeyTable(CommitKeys.of(ks, stage, session.batch, partition).table(fence))
    inputs_ids = [row[1] for row in fresh]
    marked = [row for row in fresh if row[1] not in unmarked] if unmarked else fresh
    rids = [row[1] for row in marked] if unmarked else inputs_ids
    fields, runs, order = addressing.address_runs(stage, rids, session.generation, keys)
    values = b""
    if fingerprints:  # in the fields' order; 4 bytes each (kernel.seen_layout.fingerprint_value)
        known = np.array(list(map(fingerprints.get, rids, repeat(0, len(rids)))), dtype=">u4")
        values = known[order].tobytes()
    if not inputs_ids:
        inputs: tuple[str, bytes] = ("", b"")
    else:
        inputs = inputs_args(chunk, inputs_ids)
    writes = state_args(ks, partition, updates, keys)
    sent = sum(map((-1).__lt__, map(_TARGET, outputs)))  # targets >= 0 (< 0: deltas)
    session.count("committed", len(fresh))
    session.count("out", sent)
    args = commit_args(
        fence,
        seen_value=session.seen_value,
        chunk=chunk_args(chunk, outputs),
        journal=journal_entry(session.generation, b"".join(rids)),
        seen=SeenBlob(len(rids), fields, runs),
        generation=session.generation,
        newest=max(map(_TS, marked), default=0),
        oldest=min(map(_TS, marked), default=0),
        inputs=inputs,
        values=values,
        lanes=[(lane, newest, batch_time_ms) for lane, newest in lanes.items()],
        state=writes,
        stats=session.pending,
    )
    reply = session.check(session.store.script("commit", keys.keys, args))
    session.round_trip()
    if reply[0] == FLOOR:  # nothing was stored
        session.uncount({"committed": len(fresh), "out": sent})
        raise FloorRaised(int(reply[1]))
    if reply[0] == CONFLICT:  # nothing was stored
        session.uncount({"committed": len(fresh), "out": sent})
        positions = [rids[order[int(j) - 1]] for j in reply[1]]  # positions in shard order
        conflicts = set(positions)
        held = dict(zip(positions, reply[2], strict=True)) if len(reply) > 2 else {}
        other = {r for r, v in held.items() if not same_content(v, (fingerprints or {}).get(r, 0))}
        session.count("duplicates", len(conflicts - other))
        session.count("id_conflicts", len(other))
        return 0, conflicts, other
    session.pending.clear()
    return int(reply[1]), set(), set()
