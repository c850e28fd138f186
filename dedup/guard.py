"""Per-task guards backed by Redis: exactly-once, and the at-least-once baseline.

:class:`ExactlyOnceGuard` implements the task hooks described in
:mod:`graph_optimizer.compile.task` for one stage, micro-batch and partition:

* ``open``: bump the task's fencing token, read the task's backup (replayed, never
  recomputed) and make every receiver's Bloom filters trustworthy (catch up from the journal
  or the snapshot; see :mod:`dedup.bloom`);
* ``admit``: the Bloom filter of the record's time bucket says "no" (new) or "maybe"; only the
  maybes are settled by one Redis lookup per chunk. Records older than the dedup horizon are
  returned as late (they become dead letters: they can no longer be deduplicated);
* ``commit``: one Lua call (:data:`dedup.scripts.COMMIT`) checks-and-marks the IDs, stores the
  outputs and the state;
* sinks: ``undelivered`` skips what an earlier attempt delivered, ``delivered`` marks what the
  sink acknowledged.

Receivers are the stage itself (its inputs) and each sink it writes (``<sink>/delivered``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from backup.store import TaskBackup, chunk_field, encode_outputs
from dedup.bloom import ReceiverFilters
from dedup.config import DedupConfig
from dedup.errors import FencedError
from dedup.scripts import Scripts
from graph_optimizer.compile.body import InRow, Mode
from graph_optimizer.compile.spec import StageSpec, TargetSpec
from graph_optimizer.compile.task import Admission, HorizonMovedError, NoGuard, Replay
from onceflow.keyspace import Keyspace
from onceflow.records import Output
from onceflow.settings import RedisSettings, redis_client

DELIVERED = "/delivered"
_REDIS_ONLY = frozenset({"in", "duplicates", "late", "committed", "out", "horizon_redone"})

# Filters live as long as the Python worker process: Spark reuses workers across tasks.
_FILTERS: dict[tuple[str, str, int], ReceiverFilters] = {}
_SCRIPTS: dict[int, Scripts] = {}


def _scripts(client: Any) -> Scripts:
    found = _SCRIPTS.get(id(client))
    if found is None:
        found = Scripts(client)
        _SCRIPTS[id(client)] = found
    return found


def read_state(
    client: Any, ks: Keyspace, node: str, partition: int, keys: Sequence[bytes]
) -> dict[bytes, bytes | None]:
    """Accumulators of ``keys`` in a stateful combine's partition (one HMGET)."""
    values = client.hmget(ks.state(node, partition), list(keys))
    return dict(zip(keys, values, strict=True))


def receiver_name(target: TargetSpec) -> str:
    """Redis name of a sink's delivered-set (stage names never contain '/')."""
    return target.name + DELIVERED


@dataclass(frozen=True)
class ExactlyOnceGuards:
    """Guard factory for one driver epoch (pickled to the workers)."""

    redis: RedisSettings
    namespace: str
    epoch: int
    config: DedupConfig

    def __call__(self, spec: StageSpec, batch: int, partition: int, attempt: int) -> Any:
        """A guard for one task."""
        return ExactlyOnceGuard(self, spec, batch, partition)


@dataclass(frozen=True)
class AtLeastOnceGuards:
    """The baseline: keyed state in Redis, no IDs, no backup, no dedup."""

    redis: RedisSettings
    namespace: str
    config: DedupConfig

    def __call__(self, spec: StageSpec, batch: int, partition: int, attempt: int) -> Any:
        """A guard for one task."""
        return AtLeastOnceGuard(self, partition)


class _Receiver:
    """One receiver of a task: its name, filters and what Redis said about them."""

    def __init__(self, namespace: str, name: str, partition: int, config: DedupConfig) -> None:
        self.name = name
        key = (namespace, name, partition)
        filters = _FILTERS.get(key)
        if filters is None:
            filters = ReceiverFilters(config.bloom_capacity, config.bloom_error)
            _FILTERS[key] = filters
        self.filters = filters
        self.trusted = False
        self.redis_seq = 0
        self.snapshot_seq = 0
        self.cache_key = key


def _admission(rows: list[InRow], decision: list[str]) -> Admission:
    adm = Admission([])
    for row, d in zip(rows, decision, strict=True):
        if d == "fresh":
            adm.fresh.append(row)
        elif d == "replay":
            adm.replayed.append(row)
        elif d == "dup":
            adm.duplicates += 1
        else:
            adm.late.append(row)
    return adm


class ExactlyOnceGuard:
    """Exactly-once hooks of one task (see the module docstring)."""

    mode = Mode.EXACTLY_ONCE

    def __init__(
        self, factory: ExactlyOnceGuards, spec: StageSpec, batch: int, partition: int
    ) -> None:
        self.config = factory.config
        self.chunk_size = factory.config.chunk_size
        self.ks = Keyspace(factory.namespace)
        self.client = redis_client(factory.redis)
        self.scripts = _scripts(self.client)
        self.epoch = str(factory.epoch)
        self.spec = spec
        self.batch = batch
        self.partition = partition
        self.owner = f"{batch}.{partition}".encode()
        self.token = ""
        self.floor = 0
        self.stage = _Receiver(factory.namespace, spec.name, partition, self.config)
        self.sinks = {
            t.index: _Receiver(factory.namespace, receiver_name(t), partition, self.config)
            for t in spec.targets
            if not t.is_row
        }
        self.admitted: set[bytes] = set()
        self._seen_names: dict[tuple[str, int], list[str]] = {}
        self.pending: dict[str, int] = {}
        self.counters: dict[str, int] = {}
        self._admitted_counts: dict[str, int] = {}

    # -- bookkeeping ------------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        if n:
            self.counters[name] = self.counters.get(name, 0) + n
            self.pending[name] = self.pending.get(name, 0) + n

    def _round_trip(self) -> None:
        self.counters["redis_round_trips"] = self.counters.get("redis_round_trips", 0) + 1

    def _stat_args(self) -> list[Any]:
        args: list[Any] = [len(self.pending)]
        for name, n in self.pending.items():
            args += [name, n]
        return args

    def _check(self, reply: Any) -> Any:
        if reply and reply[0] == b"fenced":
            who = reply[1].decode()
            msg = (
                f"stage {self.spec.name!r} batch {self.batch} partition {self.partition}: a "
                f"newer {who} owns this work; this {who} must stop (fenced)"
            )
            raise FencedError(msg)
        return reply

    # -- open ---------------------------------------------------------------------------------

    def open(self) -> Replay:
        """Fence older attempts, read the backup, make the filters trustworthy."""
        ks = self.ks
        receivers = [self.stage, *self.sinks.values()]
        pipe = self.client.pipeline(transaction=False)
        pipe.incr(ks.token(self.spec.name, self.partition))
        pipe.get(ks.acked_watermark)
        pipe.hgetall(ks.backup(self.spec.name, self.batch, self.partition))
        for r in receivers:
            pipe.get(ks.filter_seq(r.name, self.partition))
            pipe.hget(ks.filter_snapshot(r.name, self.partition), "seq")
        replies = pipe.execute()
        self._round_trip()
        self.token = str(replies[0])
        self.floor = self.config.floor(int(replies[1] or 0))
        backup = TaskBackup.parse(replies[2])
        for n, r in enumerate(receivers):
            r.redis_seq = int(replies[3 + 2 * n] or 0)
            r.snapshot_seq = int(replies[4 + 2 * n] or 0)
        self._catch_up(receivers)
        return Replay(backup.outputs, backup.done, backup.next_chunk)

    def _catch_up(self, receivers: list[_Receiver]) -> None:
        """Bring each receiver's filters up to Redis's commit count before trusting them."""
        need_journal = []
        need_snapshot = []
        for r in receivers:
            f = r.filters
            if f.seq == r.redis_seq:
                r.trusted = True
            elif r.snapshot_seq <= f.seq < r.redis_seq:
                need_journal.append(r)
            else:  # new, restarted, or too far behind: start from the snapshot
                fresh = ReceiverFilters(self.config.bloom_capacity, self.config.bloom_error)
                _FILTERS[r.cache_key] = fresh
                r.filters = fresh
                need_snapshot.append(r)
        if not need_journal and not need_snapshot:
            return
        ks = self.ks
        pipe = self.client.pipeline(transaction=False)
        for r in need_journal:
            pipe.lrange(
                ks.filter_journal(r.name, self.partition), r.filters.seq - r.snapshot_seq, -1
            )
        for r in need_snapshot:
            pipe.hgetall(ks.filter_snapshot(r.name, self.partition))
            pipe.lrange(ks.filter_journal(r.name, self.partition), 0, -1)
        replies = pipe.execute()
        self._round_trip()
        for r, entries in zip(need_journal, replies, strict=False):
            self._apply_journal(r, entries, r.filters.seq)
        rest = replies[len(need_journal) :]
        for n, r in enumerate(need_snapshot):
            snapshot, entries = rest[2 * n], rest[2 * n + 1]
            base = 0
            for field, blob in snapshot.items():
                name = field.decode()
                if name == "seq":
                    base = int(blob)
                elif name.startswith("b"):
                    r.filters.load_bucket(int(name[1:]), blob)
            r.filters.seq = base
            self._count("bloom_loaded_snapshots", 1 if snapshot else 0)
            self._apply_journal(r, entries, base)

    def _apply_journal(self, r: _Receiver, entries: list[bytes], start_seq: int) -> None:
        """Add the IDs of commits ``start_seq + 1 .. redis_seq`` (one journal entry each)."""
        ids: list[bytes] = []
        buckets: list[int] = []
        for entry in entries:
            for bucket, blob in msgpack.unpackb(entry, raw=False):
                chunk = [blob[i : i + 16] for i in range(0, len(blob), 16)]
                ids.extend(chunk)
                buckets.extend([bucket] * len(chunk))
        r.filters.add(ids, buckets)
        applied = len(entries)
        if applied == r.redis_seq - start_seq:
            r.filters.seq = r.redis_seq
            r.trusted = True
            self._count("bloom_journal_entries", applied)
        else:  # the journal does not reach back far enough: rebuild from the seen-IDs
            self._rebuild(r)

    def _rebuild(self, r: _Receiver) -> None:
        fresh = ReceiverFilters(self.config.bloom_capacity, self.config.bloom_error)
        cursor = 0
        while True:  # one round trip per SCAN step, not per shard
            cursor, keys = self.client.scan(cursor, match=self.ks.seen_pattern(r.name), count=1000)
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.hkeys(key)
            for key, ids in zip(keys, pipe.execute() if keys else [], strict=True):
                fresh.add(ids, [int(key.decode().rsplit(":", 2)[1])] * len(ids))
            self._round_trip()
            if cursor == 0:
                break
        fresh.seq = r.redis_seq
        _FILTERS[r.cache_key] = fresh
        r.filters = fresh
        r.trusted = True
        self._count("bloom_rebuilds")

    # -- receiving ------------------------------------------------------------------------

    def admit(self, rows: list[InRow]) -> Admission:
        """Bloom first (one batch per chunk), Redis only for maybes; see the module docstring."""
        decision, candidates = self._triage(rows)
        maybes = self._maybe(self.stage, [(rows[i][1], rows[i][2]) for i in candidates])
        asks = [i for i, m in zip(candidates, maybes, strict=True) if m]
        for i, m in zip(candidates, maybes, strict=True):
            if not m:
                decision[i] = "fresh"
        if asks:
            owners = self._lookup([(rows[i][1], rows[i][2]) for i in asks])
            for i, owner in zip(asks, owners, strict=True):
                decision[i] = self._settle(owner)
        adm = _admission(rows, decision)
        self._admitted_counts = {
            "in": len(rows),
            "bloom_maybe": len(asks),
            "duplicates": adm.duplicates,
            "late": len(adm.late),
        }
        for name, n in self._admitted_counts.items():
            self._count(name, n)
        return adm

    def _triage(self, rows: list[InRow]) -> tuple[list[str], list[int]]:
        """Late and in-task duplicates are decided at once; the rest are candidates."""
        bucket_ms = self.config.bucket_ms
        decision = [""] * len(rows)
        candidates: list[int] = []
        in_chunk: set[bytes] = set()
        for i, row in enumerate(rows):
            rid = row[1]
            if row[2] // bucket_ms < self.floor:
                decision[i] = "late"
            elif rid in in_chunk or rid in self.admitted:
                decision[i] = "dup"
            else:
                in_chunk.add(rid)
                candidates.append(i)
        return decision, candidates

    def _settle(self, owner: bytes | None) -> str:
        """What a Redis answer means: unseen, committed by an earlier attempt, or a copy."""
        if owner is None:
            return "fresh"
        return "replay" if owner == self.owner else "dup"

    def _maybe(self, rx: _Receiver, items: Sequence[tuple[bytes, int]]) -> list[bool]:
        """Bloom answers for ``(id, ts)`` pairs, adding them; all "maybe" if not trusted."""
        if not items:
            return []
        bucket_ms = self.config.bucket_ms
        answers = rx.filters.check_and_add(
            [rid for rid, _ in items],
            [ts // bucket_ms for _, ts in items],
            [self._neighbour(ts) for _, ts in items],
        )
        return answers if rx.trusted else [True] * len(items)

    def _neighbour(self, ts: int) -> int | None:
        n = self.config.neighbour(ts)
        return n if n is not None and n >= self.floor else None

    def _lookup(
        self, items: Sequence[tuple[bytes, int]], receiver: str | None = None
    ) -> list[bytes | None]:
        """Owner of each ``(id, ts)`` in the authoritative store (None when unseen)."""
        name = receiver or self.spec.name
        keys: dict[str, int] = {}
        args: list[Any] = [len(items)]
        for rid, ts in items:
            own, alt = self._shard_keys(name, rid, ts, keys)
            args += [rid, own, alt]
        reply = self.scripts.lookup(keys=list(keys), args=args)
        self._round_trip()
        self._count("redis_lookups", len(items))
        return [o if o else None for o in reply]

    def _shard_keys(self, name: str, rid: bytes, ts: int, keys: dict[str, int]) -> tuple[int, int]:
        """KEYS indices of one ID's shard and of its neighbour-bucket shard (or 0)."""
        cfg = self.config
        shard = cfg.shard(rid)
        own = keys.setdefault(self._seen_key(name, ts // cfg.bucket_ms, shard), len(keys) + 1)
        neighbour = self._neighbour(ts)
        if neighbour is None:
            return own, 0
        alt = keys.setdefault(self._seen_key(name, neighbour, shard), len(keys) + 1)
        return own, alt

    def _address(
        self, name: str, rids: list[bytes], tss: list[int], keys: dict[str, int], near: bool
    ) -> tuple[bytes, bytes, bytes, bytes]:
        """A chunk's IDs, addressed for a script.

        Returns the IDs blob, their shard indices, their neighbour-bucket shard indices (empty
        when no ID is near a bucket edge, or ``near`` is False) and the journal entry.
        """
        cfg = self.config
        blob = b"".join(rids)
        if not rids:
            return b"", b"", b"", msgpack.packb([], use_bin_type=True)
        raw = np.frombuffer(blob, dtype=np.uint8).reshape(-1, 16)
        shards = ((raw[:, 0].astype(np.int64) << 8) | raw[:, 1]) % cfg.shards
        ts = np.asarray(tss, dtype=np.int64)
        buckets = ts // cfg.bucket_ms
        owns = self._key_indices(name, buckets, shards, keys)
        alts = b""
        if near:
            offset = ts - buckets * cfg.bucket_ms
            low, high = offset < cfg.skew_ms, (cfg.bucket_ms - offset) <= cfg.skew_ms
            if low.any() or high.any():
                alt_bucket = np.where(low, buckets - 1, buckets + 1)
                valid = (low | high) & (alt_bucket >= self.floor)
                index = np.zeros(len(rids), dtype=np.int64)
                if valid.any():
                    index[valid] = self._key_indices(name, alt_bucket[valid], shards[valid], keys)
                alts = index.astype("<u2").tobytes()
        entries = [
            [int(b), b"".join(rids[i] for i in np.flatnonzero(buckets == b))]
            for b in np.unique(buckets)
        ]
        journal = msgpack.packb(entries, use_bin_type=True)
        return blob, owns.astype("<u2").tobytes(), alts, journal

    def _key_indices(
        self, name: str, buckets: np.ndarray, shards: np.ndarray, keys: dict[str, int]
    ) -> np.ndarray:
        codes = buckets * 65536 + shards
        unique, inverse = np.unique(codes, return_inverse=True)
        index = np.array(
            [
                keys.setdefault(self._seen_key(name, int(c) >> 16, int(c) & 0xFFFF), len(keys) + 1)
                for c in unique
            ],
            dtype=np.int64,
        )
        return index[inverse]

    def _seen_key(self, name: str, bucket: int, shard: int) -> str:
        """Key of a seen-ID shard (names cached: thousands are built per chunk otherwise)."""
        names = self._seen_names.get((name, bucket))
        if names is None:
            prefix = self.ks.seen(name, bucket, 0)[:-1]
            names = [f"{prefix}{s}" for s in range(self.config.shards)]
            self._seen_names[(name, bucket)] = names
        return names[shard]

    def read_state(self, node: str, keys: Sequence[bytes]) -> Mapping[bytes, bytes | None]:
        """Current accumulators of ``keys`` for a stateful combine of this partition."""
        if not keys:
            return {}
        self._round_trip()
        return read_state(self.client, self.ks, node, self.partition, keys)

    # -- committing -----------------------------------------------------------------------

    def commit(
        self,
        chunk: int,
        fresh: list[InRow],
        outputs: list[Output],
        updates: Mapping[str, Mapping[bytes, bytes]],
    ) -> set[bytes]:
        """Atomically mark ``fresh`` seen and store outputs and state; see scripts.COMMIT."""
        if not fresh and not outputs and not any(updates.values()):
            return set()
        ks = self.ks
        fixed = [
            ks.epoch,
            ks.token(self.spec.name, self.partition),
            ks.backup(self.spec.name, self.batch, self.partition),
            ks.filter_seq(self.spec.name, self.partition),
            ks.filter_journal(self.spec.name, self.partition),
            ks.stats(self.spec.name),
            ks.watermark,
            ks.gc_floor,
        ]
        keys: dict[str, int] = {k: n + 1 for n, k in enumerate(fixed)}
        rids = [row[1] for row in fresh]
        tss = [row[2] for row in fresh]
        ids_blob, owns, alts, journal = self._address(self.spec.name, rids, tss, keys, True)
        max_ts = max(tss, default=0)
        state_args: list[Any] = []
        n_state = 0
        for node, values in updates.items():
            index = keys.setdefault(ks.state(node, self.partition), len(keys) + 1)
            for kb, value in values.items():
                state_args += [index, kb, value]
                n_state += 1
        self._count("committed", len(fresh))
        sent = sum(1 for o in outputs if o.target >= 0)
        self._count("out", sent)
        args = [
            self.epoch,
            self.token,
            self.owner,
            chunk_field(chunk),
            encode_outputs(outputs),
            journal,
            max_ts,
            len(fresh),
            ids_blob,
            owns,
            alts,
            self.floor,
            n_state,
            *state_args,
            *self._stat_args(),
        ]
        reply = self._check(self.scripts.commit(keys=list(keys), args=args))
        self._round_trip()
        if reply[0] in (b"floor", b"conflict"):  # nothing was stored
            self._count("committed", -len(fresh))
            self._count("out", -sent)
        if reply[0] == b"floor":  # GC moved the horizon: admit the chunk again
            for name, n in self._admitted_counts.items():
                self.counters[name] = self.counters.get(name, 0) - n
                self.pending[name] = self.pending.get(name, 0) - n
            self.floor = max(self.floor, int(reply[1]))
            self._count("horizon_redone")
            raise HorizonMovedError(self.spec.name)
        if reply[0] == b"conflict":  # copies committed meanwhile by another partition's task
            flat = reply[1]
            conflicts = {bytes(flat[i]) for i in range(0, len(flat), 2)}
            self._count("duplicates", len(conflicts))
            return conflicts
        self.pending.clear()
        seq = int(reply[1])
        if seq > 0:
            self.stage.filters.seq = seq
        self.admitted.update(row[1] for row in fresh)
        return set()

    def finish(self, outputs: list[Output], updates: Mapping[str, Mapping[bytes, bytes]]) -> None:
        """Store the end-of-task outputs and mark the task done, in one step."""
        ks = self.ks
        keys = [
            ks.epoch,
            ks.token(self.spec.name, self.partition),
            ks.backup(self.spec.name, self.batch, self.partition),
            ks.stats(self.spec.name),
        ]
        blob = encode_outputs(outputs) if outputs else b""
        self._count("out", sum(1 for o in outputs if o.target >= 0))
        args = [self.epoch, self.token, blob, *self._stat_args()]
        self._check(self.scripts.finish(keys=keys, args=args))
        self._round_trip()
        self.pending.clear()

    # -- sinks ----------------------------------------------------------------------------

    def undelivered(self, target: TargetSpec, outputs: list[Output]) -> list[Output]:
        """Sink records no attempt has delivered yet."""
        rx = self.sinks[target.index]
        maybes = self._maybe(rx, [(o.id, o.ts) for o in outputs])
        asks = [i for i, m in enumerate(maybes) if m]
        keep = [True] * len(outputs)
        if asks:
            owners = self._lookup([(outputs[i].id, outputs[i].ts) for i in asks], rx.name)
            for i, owner in zip(asks, owners, strict=True):
                keep[i] = owner is None
        return [o for o, k in zip(outputs, keep, strict=True) if k]

    def delivered(self, target: TargetSpec, outputs: list[Output]) -> None:
        """Mark sink records delivered (after the sink acknowledged them)."""
        rx = self.sinks[target.index]
        ks = self.ks
        fixed = [
            ks.epoch,
            ks.token(self.spec.name, self.partition),
            ks.filter_seq(rx.name, self.partition),
            ks.filter_journal(rx.name, self.partition),
            ks.stats(rx.name),
        ]
        keys: dict[str, int] = {k: n + 1 for n, k in enumerate(fixed)}
        ids_blob, owns, _alts, journal = self._address(
            rx.name, [o.id for o in outputs], [o.ts for o in outputs], keys, False
        )
        args = [self.epoch, self.token, self.owner, journal, len(outputs), ids_blob, owns]
        reply = self._check(self.scripts.mark_delivered(keys=list(keys), args=args))
        self._round_trip()
        seq, again = int(reply[1]), int(reply[2])
        if seq > 0:
            rx.filters.seq = seq
        self._count("delivered", len(outputs) - again)
        self._count("delivered_again", again)

    # -- closing --------------------------------------------------------------------------

    def close(self) -> dict[str, int]:
        """Snapshot filters whose journal grew long; return counters for the run."""
        for rx in [self.stage, *self.sinks.values()]:
            self._maybe_snapshot(rx)
        # "in", "duplicates", "late" and "committed" go to Redis only: the task counts its own.
        counters = {k: v for k, v in self.counters.items() if k not in _REDIS_ONLY}
        counters["bloom_bytes"] = sum(
            rx.filters.memory_bytes() for rx in [self.stage, *self.sinks.values()]
        )
        return counters

    def _maybe_snapshot(self, rx: _Receiver) -> None:
        f = rx.filters
        dropped = f.drop_before(self.floor)
        if f.seq - rx.snapshot_seq < self.config.snapshot_every or not rx.trusted:
            return
        ks = self.ks
        keys = [
            ks.epoch,
            ks.token(self.spec.name, self.partition),
            ks.filter_seq(rx.name, self.partition),
            ks.filter_journal(rx.name, self.partition),
            ks.filter_snapshot(rx.name, self.partition),
        ]
        dirty = sorted(f.dirty)
        args: list[Any] = [self.epoch, self.token, f.seq, len(dirty)]
        for bucket in dirty:
            args += [f"b{bucket}", f.dump_bucket(bucket)]
        args += [len(dropped), *(f"b{b}" for b in dropped)]
        try:
            reply = self.scripts.snapshot(keys=keys, args=args)
        except Exception:  # noqa: BLE001 - a snapshot is an optimisation; the journal remains
            return
        self._round_trip()
        if reply and reply[0] == b"ok":
            f.dirty.clear()
            self._count("bloom_snapshots")


class AtLeastOnceGuard(NoGuard):
    """Keyed state in Redis, read-merge-write per chunk; otherwise a :class:`NoGuard`."""

    mode = Mode.AT_LEAST_ONCE

    def __init__(self, factory: AtLeastOnceGuards, partition: int) -> None:
        self.chunk_size = max(factory.config.chunk_size, 5000)
        self.ks = Keyspace(factory.namespace)
        self.client = redis_client(factory.redis)
        self.partition = partition
        self.round_trips = 0

    def read_state(self, node: str, keys: Sequence[bytes]) -> Mapping[bytes, bytes | None]:
        """Current accumulators."""
        if not keys:
            return {}
        self.round_trips += 1
        return read_state(self.client, self.ks, node, self.partition, keys)

    def commit(
        self,
        chunk: int,
        fresh: list[InRow],
        outputs: list[Output],
        updates: Mapping[str, Mapping[bytes, bytes]],
    ) -> set[bytes]:
        """Write state (not atomically with anything: a crash may apply a chunk twice)."""
        if any(updates.values()):
            pipe = self.client.pipeline(transaction=False)
            for node, values in updates.items():
                if values:
                    pipe.hset(self.ks.state(node, self.partition), mapping=dict(values))
            pipe.execute()
            self.round_trips += 1
        return set()

    def close(self) -> dict[str, int]:
        """Round trips, for the benchmark."""
        return {"redis_round_trips": self.round_trips}
