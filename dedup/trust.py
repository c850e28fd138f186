"""When a receiver's Bloom filters may be trusted, and how they are made trustworthy.

A receiver's filters cover the IDs committed by *all* its partitions (a copy of a record
may arrive in any partition), or by one partition when the receiver keeps its state per
partition scope (:mod:`onceflow.kernel.scopes`), and live as long as the Python worker
(Spark reuses workers across tasks). ``seq`` counts the commits the filters cover; Redis
counts every commit to the receiver. At the start of a task the two are compared: equal, the
filters are trusted; behind, they are caught up from the journal of commits since the last
snapshot; new, restarted or too far behind, they are loaded from the snapshot and the
journal, or, when the journal does not reach back far enough, rebuilt from the seen-IDs
themselves. Until then every answer is "maybe" (a filter never says "not seen" for IDs it
has not covered).

Commits made by other partitions *during* a task are not in its filters; they belong to the
same micro-batch and so to the same generation, where the commit's check-and-set catches a
copy (:data:`onceflow.kernel.scripts.COMMIT`).

A snapshot covers a prefix of the commits (``seq``): the partitions of a source stage commit
at the same time, so a task's filters rarely cover *every* commit when it closes. It is
refused only when it would go back (another worker's covers more) or claim more than Redis
holds, and it trims the journal to the commits after the *previous* snapshot, so that the
workers it overtook catch up from the journal instead of reloading the whole snapshot.
Measured with ``bench/bloom_journal.py`` (an hour of 1 s batches): when a snapshot had to
cover every commit, 97% were refused with 2 partitions and all but 43 of 13,004 with 4, whose
journal reached 2,560 entries (~10 MB, read whole by every new worker: up to 9 s); committing
in chunks of 250, it grew by 16 entries a batch without a single snapshot (25,324 entries,
99 MB after 1,800 batches). Now it stays under 100 entries in each of these.

Filters remember the Redis server instance they were caught up against (``INFO`` run_id):
a restarted server may have lost acknowledged writes (a host crash under ``appendfsync
everysec``) and then taken other commits under the same numbers, so filters of another
instance are reloaded from the snapshot and journal, never caught up on top. Filters that
cover more commits than the *same* instance holds mean Redis lost writes without restarting
(or the namespace's keys were deleted under a running application): a clear stop.
"""

from __future__ import annotations

import msgpack

from onceflow.dedup.bloom import ReceiverFilters
from onceflow.dedup.config import DedupConfig
from onceflow.dedup.errors import FiltersAheadError
from onceflow.dedup.session import TaskSession
from onceflow.kernel import script_args
from onceflow.kernel.errors import CodecError
from onceflow.kernel.ids import ID_BYTES
from onceflow.kernel.seen_layout import seen_id

SCAN_STEP = 1000
SNAPSHOT_OK = b"ok"
GENERATION_FIELD = "g"  # snapshot hash fields: "g<generation>" -> serialized filters
SEQ_FIELD = "seq"
RELOAD = -1  # CATCH_UP's "covered" that makes it return the snapshot and the journal after it

# Filters live as long as the Python worker process: Spark reuses workers across tasks.
_FILTERS: dict[tuple[str, str], ReceiverFilters] = {}


def _new_filters(config: DedupConfig) -> ReceiverFilters:
    return ReceiverFilters(config.bloom_capacity, config.filter_error)


class Receiver:
    """One receiver of a task: its filters and what Redis said about them."""

    def __init__(self, tag: str, name: str, config: DedupConfig) -> None:
        self.name = name
        self.cache_key = (tag, name)
        filters = _FILTERS.get(self.cache_key)
        if filters is None:
            filters = _new_filters(config)
            _FILTERS[self.cache_key] = filters
        self.filters = filters
        self.trusted = False
        self.redis_seq = 0
        self.snapshot_seq = 0

    def committed(self, seq: int, generation: int) -> None:
        """This task's commit (into ``generation``) became commit number ``seq`` of the receiver.

        The caller has added the commit's IDs to the filters. They cover it only if no other
        partition committed since they were caught up (``seq`` follows theirs); otherwise
        they stay behind and the next task catches up from the journal, skipping this
        commit's entry (tasks of two workers commit in turn: without the skip, each worker
        added its own IDs a second time, ~2.5 adds per ID in all).
        """
        f = self.filters
        if seq == f.seq + 1:
            f.seq = seq
            while f.seq + 1 in f.ahead:  # own commits made while another was missing
                del f.ahead[f.seq + 1]
                f.seq += 1
        elif seq > f.seq:
            f.ahead[seq] = generation  # catching up skips its journal entry: the IDs are here

    def replace_filters(self, filters: ReceiverFilters) -> None:
        """Use (and cache) other filters for this receiver partition."""
        _FILTERS[self.cache_key] = filters
        self.filters = filters


def catch_up(session: TaskSession, receivers: list[Receiver], server: str = "") -> None:
    """Bring each receiver's filters up to Redis's commit count before trusting them.

    Filters behind are caught up from the journal, read with the commit count and the
    snapshot's sequence in one atomic step (:data:`~onceflow.kernel.scripts.CATCH_UP`);
    filters behind the snapshot (new, restarted), ahead of Redis or caught up against
    another instance of the server (``server``: its run_id, '' unknown) start from the
    snapshot. Filters ahead of the same instance are an error (:func:`_refuse_ahead`).
    """
    for r in receivers:
        _refuse_ahead(r, server)
    todo = [r for r in receivers if r.filters.seq != r.redis_seq or _moved(r.filters, server)]
    for r in receivers:
        r.trusted = r not in todo
    if todo:
        _catch_up(session, todo, server)
    if server:
        for r in receivers:
            r.filters.server = server


def _moved(filters: ReceiverFilters, server: str) -> bool:
    """Whether the filters were caught up against another instance of the Redis server."""
    return bool(server and filters.server and filters.server != server)


def _refuse_ahead(r: Receiver, server: str) -> None:
    """Raise if the filters cover commits the same Redis instance no longer holds.

    Commit numbers only grow on one instance: fewer means Redis dropped acknowledged writes
    without a restart, or the namespace's keys were deleted while this worker kept its filters.
    Neither is something to reload quietly over.
    """
    f = r.filters
    covered = max(f.seq, max(f.ahead, default=0))
    if covered <= r.redis_seq or not server or f.server != server:
        return
    msg = (
        f"receiver {r.name!r}: this worker's Bloom filters cover {covered} commits but Redis "
        f"holds {r.redis_seq}, on the same server instance (run_id {server}): Redis lost "
        "acknowledged writes without restarting, or the pipeline's keys were deleted (onceflow "
        "reset) while this Spark application ran. Check Redis's persistence and replication, "
        "then restart the Spark application"
    )
    raise FiltersAheadError(msg)


def _catch_up(session: TaskSession, todo: list[Receiver], server: str) -> None:
    """Catch up (or reload) the filters of ``todo`` in one round trip."""
    ks = session.ks
    cmds = session.store.batch()
    for r in todo:
        covered = RELOAD if _moved(r.filters, server) else r.filters.seq
        keys, args = script_args.catch_up(
            ks.filter_seq(r.name), ks.filter_journal(r.name), ks.filter_snapshot(r.name), covered
        )
        cmds.script("catch_up", keys, args)
    replies = cmds.execute()
    session.round_trip()
    for r, reply in zip(todo, replies, strict=True):
        r.redis_seq, r.snapshot_seq, entries = int(reply[0]), int(reply[1]), reply[2]
        if len(reply) == 3:
            _apply_journal(session, r, entries, r.filters.seq)
            continue
        r.replace_filters(_new_filters(session.config))
        flat = reply[3]
        snapshot = dict(zip(flat[::2], flat[1::2], strict=True))
        base = _load_snapshot(r, snapshot)
        session.count("bloom_loaded_snapshots", 1 if snapshot else 0)
        _apply_journal(session, r, entries, base)


def _load_snapshot(r: Receiver, snapshot: dict[bytes, bytes]) -> int:
    """Load every generation of a snapshot; return the commit sequence it covers.

    A snapshot of filters of another shape (the settings changed) is not used: the filters
    stay empty at sequence 0, and the journal (or, when it does not reach back that far, the
    seen-IDs) fills them.
    """
    base = 0
    for raw, blob in snapshot.items():
        name = raw.decode()
        if name == SEQ_FIELD:
            base = int(blob)
        elif name.startswith(GENERATION_FIELD):
            if not r.filters.load(int(name[len(GENERATION_FIELD) :]), blob):
                r.filters.generations.clear()
                r.filters.seq = 0
                return 0
    r.filters.seq = base
    return base


def generation_field(generation: int) -> str:
    """The snapshot hash field of a generation's filters."""
    return f"{GENERATION_FIELD}{generation}"


def journal_entry(generation: int, ids_blob: bytes) -> bytes:
    """One commit's journal entry: ``[[generation, concatenated 16-byte IDs]]``."""
    return msgpack.packb([[generation, ids_blob]], use_bin_type=True)  # type: ignore[no-any-return]


def _apply_journal(session: TaskSession, r: Receiver, entries: list[bytes], start: int) -> None:
    """Add the IDs of commits ``start + 1 .. redis_seq`` (one journal entry each).

    Entries of commits made through these filters (``ahead``) are skipped: their IDs are in.
    """
    ahead = r.filters.ahead
    for seq, entry in enumerate(entries, start + 1):
        if seq in ahead:
            continue
        for generation, blob in msgpack.unpackb(entry, raw=False):
            if len(blob) % ID_BYTES:
                msg = f"a Bloom journal entry of {r.name!r} holds {len(blob)} bytes of IDs"
                raise CodecError(msg)
            r.filters.add(bytes(blob), int(generation))
    if len(entries) == r.redis_seq - start:
        r.filters.seq = r.redis_seq
        r.filters.ahead = {seq: g for seq, g in ahead.items() if seq > r.redis_seq}
        r.trusted = True
        session.count("bloom_journal_entries", len(entries))
    else:  # the journal does not reach back far enough: rebuild from the seen-IDs
        _rebuild(session, r)


def _rebuild(session: TaskSession, r: Receiver) -> None:
    """Filters from the authoritative seen-IDs (one round trip per SCAN step)."""
    fresh = _new_filters(session.config)
    ks, store = session.ks, session.store
    cursor = 0
    while True:
        cursor, keys = store.scan(cursor, ks.seen_pattern(r.name), SCAN_STEP)
        cmds = store.batch()
        for key in keys:
            cmds.hkeys(key.decode() if isinstance(key, bytes) else key)
        for key, fields in zip(keys, cmds.execute() if keys else [], strict=True):
            parsed = ks.parse(key)
            if (
                parsed is not None
                and parsed.name == r.name  # not another receiver the pattern also matches
                and parsed.generation is not None
                and parsed.shard is not None
            ):
                fresh.add(_ids_of(session, fields, parsed.shard), parsed.generation)
        session.round_trip()
        if cursor == 0:
            break
    fresh.seq = r.redis_seq
    r.replace_filters(fresh)
    r.trusted = True
    session.count("bloom_rebuilds")


def _ids_of(session: TaskSession, fields: list[bytes], shard: int) -> list[bytes]:
    """The IDs a seen-ID shard's fields stand for (fields are not whole IDs)."""
    shards = session.config.shards
    return [seen_id(f, shard, shards) for f in fields]


def snapshot(session: TaskSession, r: Receiver) -> None:
    """Snapshot a receiver's filters once enough commits went by; drop forgotten generations.

    Filters of a generation are dropped once it is neither live nor held by Redis (GC
    forgot it), not as soon as it leaves a batch's live set: a raised horizon makes older
    generations live again, and their filters must still answer for them.
    A snapshot is an optimisation (the journal remains): a failed one is not an error. The
    filters are only serialized and sent when the snapshot in Redis covers fewer commits:
    the tasks of a source stage's partitions close together, and all but one would send
    megabytes to be refused.
    """
    f = r.filters
    dropped = f.keep_only({*session.live_generations, session.generation, *session.stored})
    if f.seq - r.snapshot_seq < session.config.snapshot_every or not r.trusted:
        return
    ks = session.ks
    try:  # the other partitions' tasks close at the same time: one of them may have been first
        taken = int(session.store.hget(ks.filter_snapshot(r.name), SEQ_FIELD) or 0)
    except Exception:  # noqa: BLE001 - a snapshot is an optimisation; the journal remains
        return
    session.round_trip()
    if taken >= f.seq:  # covers as much as these filters: not worth sending them
        session.count("bloom_snapshots_stale")
        return
    written = [(generation_field(g), f.dump(g)) for g in sorted(f.dirty)]
    session.count("bloom_snapshot_bytes", sum(len(blob) for _field, blob in written))
    keys, args = script_args.snapshot(
        session.fence,
        seq_key=ks.filter_seq(r.name),
        journal=ks.filter_journal(r.name),
        snapshot_key=ks.filter_snapshot(r.name),
        covered=f.seq,
        written=written,
        dropped=[generation_field(g) for g in dropped],
    )
    try:
        reply = session.store.script("snapshot", keys, args)
    except Exception:  # noqa: BLE001 - a snapshot is an optimisation; the journal remains
        return
    session.round_trip()
    if reply and reply[0] == SNAPSHOT_OK:
        # The snapshot claims commits up to f.seq only. Generations that hold IDs of own
        # commits after that stay dirty: another worker may write them from filters without
        # those IDs, and the next snapshot of these filters (claiming those commits) must
        # write them again.
        f.dirty = {g for g in f.ahead.values() if g in f.generations}
        session.count("bloom_snapshots")
    else:
        session.count("bloom_snapshots_stale")
