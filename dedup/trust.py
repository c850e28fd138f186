"""When a receiver's Bloom filters may be trusted, and how they are made trustworthy.

A receiver partition's filters live as long as the Python worker (Spark reuses workers
across tasks). ``seq`` counts the commits the filters cover; Redis counts every commit. At
the start of a task the two are compared: equal, the filters are trusted; behind, they are
caught up from the journal of commits since the last snapshot; new, restarted or too far
behind, they are loaded from the snapshot and the journal, or, when the journal does not
reach back far enough, rebuilt from the seen-IDs themselves. Until then every answer is
"maybe" (a filter never says "not seen" for IDs it has not covered).
"""

from __future__ import annotations

from typing import Any

import msgpack

from onceflow.dedup.bloom import ReceiverFilters
from onceflow.dedup.config import DedupConfig
from onceflow.dedup.session import TaskSession
from onceflow.kernel.ids import ID_BYTES

SCAN_STEP = 1000
SNAPSHOT_OK = b"ok"
BUCKET_FIELD = "b"  # snapshot hash fields: "b<bucket>" -> serialized generations
SEQ_FIELD = "seq"

# Filters live as long as the Python worker process: Spark reuses workers across tasks.
_FILTERS: dict[tuple[str, str, int], ReceiverFilters] = {}


def _new_filters(config: DedupConfig) -> ReceiverFilters:
    return ReceiverFilters(config.bloom_capacity, config.bloom_error)


class Receiver:
    """One receiver partition of a task: its filters and what Redis said about them."""

    def __init__(self, namespace: str, name: str, partition: int, config: DedupConfig) -> None:
        self.name = name
        self.cache_key = (namespace, name, partition)
        filters = _FILTERS.get(self.cache_key)
        if filters is None:
            filters = _new_filters(config)
            _FILTERS[self.cache_key] = filters
        self.filters = filters
        self.trusted = False
        self.redis_seq = 0
        self.snapshot_seq = 0

    def replace_filters(self, filters: ReceiverFilters) -> None:
        """Use (and cache) other filters for this receiver partition."""
        _FILTERS[self.cache_key] = filters
        self.filters = filters


def catch_up(session: TaskSession, receivers: list[Receiver]) -> None:
    """Bring each receiver's filters up to Redis's commit count before trusting them."""
    need_journal: list[Receiver] = []
    need_snapshot: list[Receiver] = []
    for r in receivers:
        f = r.filters
        if f.seq == r.redis_seq:
            r.trusted = True
        elif r.snapshot_seq <= f.seq < r.redis_seq:
            need_journal.append(r)
        else:  # new, restarted, or too far behind: start from the snapshot
            r.replace_filters(_new_filters(session.config))
            need_snapshot.append(r)
    if not need_journal and not need_snapshot:
        return
    ks, partition = session.ks, session.partition
    pipe = session.client.pipeline(transaction=False)
    for r in need_journal:
        pipe.lrange(ks.filter_journal(r.name, partition), r.filters.seq - r.snapshot_seq, -1)
    for r in need_snapshot:
        pipe.hgetall(ks.filter_snapshot(r.name, partition))
        pipe.lrange(ks.filter_journal(r.name, partition), 0, -1)
    replies = pipe.execute()
    session.round_trip()
    for r, entries in zip(need_journal, replies, strict=False):
        _apply_journal(session, r, entries, r.filters.seq)
    rest = replies[len(need_journal) :]
    for n, r in enumerate(need_snapshot):
        snapshot, entries = rest[2 * n], rest[2 * n + 1]
        base = _load_snapshot(r, snapshot)
        session.count("bloom_loaded_snapshots", 1 if snapshot else 0)
        _apply_journal(session, r, entries, base)


def _load_snapshot(r: Receiver, snapshot: dict[bytes, bytes]) -> int:
    """Load every bucket of a snapshot; return the commit sequence it covers."""
    base = 0
    for raw, blob in snapshot.items():
        name = raw.decode()
        if name == SEQ_FIELD:
            base = int(blob)
        elif name.startswith(BUCKET_FIELD):
            r.filters.load_bucket(int(name[len(BUCKET_FIELD) :]), blob)
    r.filters.seq = base
    return base


def journal_entry(entries: list[tuple[int, bytes]]) -> bytes:
    """One commit's journal entry: ``[[bucket, concatenated 16-byte IDs], ...]``."""
    return msgpack.packb([[b, blob] for b, blob in entries], use_bin_type=True)  # type: ignore[no-any-return]


def _apply_journal(session: TaskSession, r: Receiver, entries: list[bytes], start: int) -> None:
    """Add the IDs of commits ``start + 1 .. redis_seq`` (one journal entry each)."""
    ids: list[bytes] = []
    buckets: list[int] = []
    for entry in entries:
        for bucket, blob in msgpack.unpackb(entry, raw=False):
            chunk = [blob[i : i + ID_BYTES] for i in range(0, len(blob), ID_BYTES)]
            ids.extend(chunk)
            buckets.extend([bucket] * len(chunk))
    r.filters.add(ids, buckets)
    if len(entries) == r.redis_seq - start:
        r.filters.seq = r.redis_seq
        r.trusted = True
        session.count("bloom_journal_entries", len(entries))
    else:  # the journal does not reach back far enough: rebuild from the seen-IDs
        _rebuild(session, r)


def _rebuild(session: TaskSession, r: Receiver) -> None:
    """Filters from the authoritative seen-IDs (one round trip per SCAN step)."""
    fresh = _new_filters(session.config)
    ks, client = session.ks, session.client
    cursor = 0
    while True:
        cursor, keys = client.scan(cursor, match=ks.seen_pattern(r.name), count=SCAN_STEP)
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.hkeys(key)
        for key, ids in zip(keys, pipe.execute() if keys else [], strict=True):
            parsed = ks.parse(key)
            if parsed is not None and parsed.bucket is not None:
                fresh.add(ids, [parsed.bucket] * len(ids))
        session.round_trip()
        if cursor == 0:
            break
    fresh.seq = r.redis_seq
    r.replace_filters(fresh)
    r.trusted = True
    session.count("bloom_rebuilds")


def snapshot(session: TaskSession, r: Receiver) -> None:
    """Snapshot a receiver's filters once enough commits went by; drop buckets below the floor.

    A snapshot is an optimisation (the journal remains): a failed one is not an error.
    """
    f = r.filters
    dropped = f.drop_before(session.floor)
    if f.seq - r.snapshot_seq < session.config.snapshot_every or not r.trusted:
        return
    ks, partition = session.ks, session.partition
    keys = [
        *session.fence_keys(),
        ks.filter_seq(r.name, partition),
        ks.filter_journal(r.name, partition),
        ks.filter_snapshot(r.name, partition),
    ]
    dirty = sorted(f.dirty)
    args: list[Any] = [*session.fence_args(), f.seq, len(dirty)]
    for bucket in dirty:
        args += [f"{BUCKET_FIELD}{bucket}", f.dump_bucket(bucket)]
    args += [len(dropped), *(f"{BUCKET_FIELD}{b}" for b in dropped)]
    try:
        reply = session.scripts.snapshot(keys=keys, args=args)
    except Exception:  # noqa: BLE001 - a snapshot is an optimisation; the journal remains
        return
    session.round_trip()
    if reply and reply[0] == SNAPSHOT_OK:
        f.dirty.clear()
        session.count("bloom_snapshots")
