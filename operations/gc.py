"""Garbage collection of a pipeline namespace's exactly-once state (``onceflow gc``).

What grows without end, and when it stops mattering:

* seen-ID buckets (``seen:<receiver>:<bucket>:<shard>``): once the bucket is older than the
  dedup horizon, measured back from the newest event time of the micro-batches Spark has
  committed (the acknowledged watermark: never one a replayed batch could still move). Such
  records are dead-lettered as late by the receivers, never looked up again. One bucket of
  slack is kept, and the floor is raised in Redis *before* anything below it is deleted: a
  commit whose task still counts a deleted bucket as inside the horizon is refused by the
  commit script and redone (see :data:`dedup.scripts.COMMIT`), so a GC pass can never make a
  duplicate inside the horizon look new;
* backups (``bk:<stage>:<batch>:<partition>``, with their per-chunk commit markers): once
  Spark has committed the micro-batch (``acked``), nothing replays them;
* Bloom-filter snapshot fields of buckets below the floor.

Everything is found with SCAN (never KEYS) in bounded steps and removed with UNLINK in
batches, so a large keyspace does not stall Redis. A pass only ever reads the watermark and
the acknowledged batch that the pipeline itself committed: it cannot reach past them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from onceflow.backup.store import acknowledged, is_garbage
from onceflow.dedup.trust import BUCKET_FIELD
from onceflow.kernel.durations import DAY_MS, parse_duration_ms
from onceflow.kernel.errors import ConfigError
from onceflow.kernel.keyspace import META_PATTERN, Keyspace, Kind, floor_bucket, namespace_of_meta
from onceflow.kernel.scripts import scripts_for

# Buckets of seen-IDs kept below the dedup floor, in case a clock is a little behind.
SLACK_BUCKETS = 1
DEFAULT_SCAN_COUNT = 1000
DEFAULT_DELETE_BATCH = 500


class GcError(ConfigError):
    """A GC pass cannot run; the message says what to check."""


@dataclass
class Removed:
    """What one kind of garbage amounted to."""

    keys: int = 0
    fields: int = 0
    ids: int = 0
    bytes: int = 0


@dataclass
class GcPass:
    """The outcome of one pass over one namespace."""

    namespace: str
    dry_run: bool
    horizon_ms: int
    watermark: int
    acked: int
    floor: int | None
    removed: dict[str, Removed] = field(default_factory=dict)
    scanned: int = 0
    seconds: float = 0.0

    @property
    def total(self) -> Removed:
        """All kinds together."""
        out = Removed()
        for r in self.removed.values():
            out.keys += r.keys
            out.fields += r.fields
            out.ids += r.ids
            out.bytes += r.bytes
        return out

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        data = asdict(self)
        data["total"] = asdict(self.total)
        return data

    def log_line(self) -> str:
        """One line of structured log."""
        t = self.total
        return json.dumps(
            {
                "event": "onceflow.gc",
                "namespace": self.namespace,
                "dry_run": self.dry_run,
                "floor_bucket": self.floor,
                "acked_batch": self.acked,
                "watermark_ms": self.watermark,
                "horizon_ms": self.horizon_ms,
                "scanned_keys": self.scanned,
                "removed_keys": t.keys,
                "removed_fields": t.fields,
                "removed_ids": t.ids,
                "removed_bytes": t.bytes,
                "by_kind": {k: asdict(v) for k, v in sorted(self.removed.items())},
                "seconds": round(self.seconds, 3),
            },
            sort_keys=False,
        )


def read_meta(client: Any, ks: Keyspace) -> dict[str, str]:
    """A namespace's fixed settings; a clear error when the namespace has no state here."""
    meta = {k.decode(): v.decode() for k, v in client.hgetall(ks.meta).items()}
    if not meta:
        msg = (
            f"namespace {ks.namespace!r} has no exactly-once state in this Redis (no {ks.meta}): "
            "check the namespace (default: the pipeline's name) and REDIS_URL"
        )
        raise GcError(msg)
    return meta


def namespaces(client: Any, scan_count: int = DEFAULT_SCAN_COUNT) -> list[str]:
    """Every pipeline namespace with exactly-once state in this Redis."""
    found = set()
    for raw in client.scan_iter(match=META_PATTERN, count=scan_count):
        name = namespace_of_meta(raw)
        if name is not None:
            found.add(name)
    return sorted(found)


def scan_steps(client: Any, match: str, count: int) -> Iterator[list[str]]:
    """SCAN in bounded steps, one step's keys at a time."""
    cursor = 0
    while True:
        cursor, keys = client.scan(cursor=cursor, match=match, count=count)
        if keys:
            yield [k.decode() if isinstance(k, bytes) else k for k in keys]
        if cursor == 0:
            return


def _int(raw: Any, default: int) -> int:
    return int(raw) if raw is not None else default


def collect(
    client: Any,
    namespace: str,
    *,
    dry_run: bool = False,
    horizon: str | int | None = None,
    scan_count: int = DEFAULT_SCAN_COUNT,
    delete_batch: int = DEFAULT_DELETE_BATCH,
) -> GcPass:
    """One GC pass over one namespace (see the module docstring)."""
    t0 = time.monotonic()
    ks = Keyspace(namespace)
    meta = read_meta(client, ks)
    bucket_ms = int(meta["bucket_ms"])
    horizon_ms = _horizon(meta, horizon, namespace)
    watermark = _int(client.get(ks.acked_watermark), 0)
    acked = acknowledged(client, ks)
    floor: int | None = None
    if watermark > 0:
        candidate = floor_bucket(watermark, horizon_ms, bucket_ms) - SLACK_BUCKETS
        if candidate > 0:
            floor = candidate
    if floor is not None and not dry_run:
        floor = int(scripts_for(client).raise_floor(keys=[ks.gc_floor], args=[floor]))
    result = GcPass(namespace, dry_run, horizon_ms, watermark, acked, floor)
    for keys in scan_steps(client, ks.pattern(), scan_count):
        result.scanned += len(keys)
        victims, snapshots = _classify(ks, keys, floor, acked)
        for kind, found in victims.items():
            for start in range(0, len(found), delete_batch):
                _remove(client, found[start : start + delete_batch], kind, result, dry_run)
        if snapshots and floor is not None:
            _trim_snapshots(client, snapshots, floor, result, dry_run)
    result.seconds = time.monotonic() - t0
    if not dry_run:
        _record(client, ks, result)
    return result


def _horizon(meta: dict[str, str], horizon: str | int | None, namespace: str) -> int:
    """The pipeline's horizon, or a longer one asked for; never a shorter one."""
    horizon_ms = int(meta.get("horizon_ms", DAY_MS))
    if horizon is None:
        return horizon_ms
    wanted = parse_duration_ms(horizon)
    if wanted < horizon_ms:
        msg = (
            f"--horizon {horizon} is shorter than the horizon pipeline {namespace!r} "
            f"deduplicates over ({horizon_ms} ms): GC would delete IDs it still checks. "
            "Change the pipeline's DedupConfig instead"
        )
        raise GcError(msg)
    return wanted


def _classify(
    ks: Keyspace, keys: list[str], floor: int | None, acked: int
) -> tuple[dict[str, list[str]], list[str]]:
    """Keys to unlink by kind, and snapshot hashes to trim, among one SCAN step's keys."""
    victims: dict[str, list[str]] = {"seen_ids": [], "backups": []}
    snapshots = []
    for key in keys:
        parsed = ks.parse(key)
        if parsed is None:
            continue
        if parsed.kind is Kind.SEEN and floor is not None:
            if parsed.bucket is not None and parsed.bucket < floor:
                victims["seen_ids"].append(key)
        elif parsed.kind is Kind.BACKUP:
            if is_garbage(parsed, acked):
                victims["backups"].append(key)
        elif parsed.kind is Kind.FILTER_SNAPSHOT and floor is not None:
            snapshots.append(key)
    return victims, snapshots


def _remove(client: Any, keys: list[str], kind: str, result: GcPass, dry_run: bool) -> None:
    """Measure, then unlink, one batch of keys."""
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.memory_usage(key)
        if kind == "seen_ids":
            pipe.hlen(key)
    replies = pipe.execute()
    step = 2 if kind == "seen_ids" else 1
    removed = result.removed.setdefault(kind, Removed())
    for n in range(len(keys)):
        removed.bytes += int(replies[step * n] or 0)
        if kind == "seen_ids":
            removed.ids += int(replies[step * n + 1] or 0)
    if dry_run:
        removed.keys += len(keys)
        return
    removed.keys += int(client.unlink(*keys))


def _trim_snapshots(
    client: Any, keys: list[str], floor: int, result: GcPass, dry_run: bool
) -> None:
    """Drop snapshot fields of buckets below the floor (each HDEL is atomic on its key)."""
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.hkeys(key)
    removed = result.removed.setdefault("bloom_snapshots", Removed())
    for key, fields in zip(keys, pipe.execute(), strict=True):
        old = [f for f in (x.decode() for x in fields) if _bucket_field_below(f, floor)]
        if not old:
            continue
        pipe = client.pipeline(transaction=False)
        for f in old:
            pipe.hstrlen(key, f)
        removed.bytes += sum(int(n or 0) for n in pipe.execute())
        removed.fields += len(old)
        if not dry_run:
            client.hdel(key, *old)


def _bucket_field_below(name: str, floor: int) -> bool:
    """Whether a snapshot hash field holds the filters of a bucket below ``floor``."""
    if not name.startswith(BUCKET_FIELD):
        return False
    number = name[len(BUCKET_FIELD) :]
    return number.lstrip("-").isdigit() and int(number) < floor


def _record(client: Any, ks: Keyspace, result: GcPass) -> None:
    t = result.total
    pipe = client.pipeline(transaction=False)
    pipe.hset(
        ks.gc,
        mapping={
            "last_pass_ms": int(time.time() * 1000),
            "last_floor": -1 if result.floor is None else result.floor,
            "last_acked": result.acked,
            "last_removed_keys": t.keys,
            "last_removed_ids": t.ids,
            "last_removed_bytes": t.bytes,
            "last_seconds": round(result.seconds, 3),
            "horizon_ms": result.horizon_ms,
        },
    )
    pipe.hincrby(ks.gc, "passes", 1)
    pipe.hincrby(ks.gc, "removed_keys", t.keys)
    pipe.hincrby(ks.gc, "removed_bytes", t.bytes)
    pipe.execute()
