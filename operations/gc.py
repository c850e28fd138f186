"""Garbage collection of a pipeline namespace's exactly-once state (``onceflow gc``).

What grows without end, and when it stops mattering (stages kept per partition scope, see
:mod:`onceflow.kernel.scopes`, are collected the same way, a scope at a time, each scope
forgetting its own generations):

* seen-ID generations (``seen:<receiver>:<generation>:<shard>``): once the newest event time
  committed into the generation is older than the horizon, measured back from the watermark
  of the last micro-batch Spark has committed (never one a replayed batch could still move;
  see :mod:`onceflow.dedup.batch`), with a bucket of slack: a copy of any of its records
  would be late, so no receiver looks it up again (batches fix their live generations when
  they start, from the same rule, and their watermark only grows). The generation is
  forgotten atomically (``gens``, re-checked by a script) before its keys are deleted;
* backups (``bk:<stage>:<batch>:<partition>``, with their per-chunk commit markers) and batch
  parameters (``batch:<n>``) of micro-batches Spark has committed (``acked``): nothing
  replays them (the last acknowledged batch's parameters stay: GC measures from them);
* Bloom-filter snapshot fields of forgotten generations;
* keyed state with a time-to-live (``combine_per_key(..., ttl=...)``) whose expiry, in batch
  time, is at or before the last acknowledged batch's time: every batch that may still run
  has a time at least that late, so each of them already reads that state as gone. A key
  is deleted by a script that re-checks its expiry (a commit that updated it meanwhile moved
  the expiry on, and the key stays). Window state needs no pass: a window's state is deleted
  in the same commit as its final pane.

Everything is found with SCAN (never KEYS) in bounded steps and removed with UNLINK in
batches, so a large keyspace does not stall Redis. A pass only ever reads the dedup time and
the acknowledged batch that the pipeline itself committed: it cannot reach past them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from onceflow.backup.store import acknowledged, is_garbage
from onceflow.dedup.aof import settle_aof
from onceflow.dedup.batch import BatchParams, read_batch_params
from onceflow.dedup.trust import GENERATION_FIELD
from onceflow.kernel import script_args
from onceflow.kernel.durations import DAY_MS, Duration, parse_duration_ms
from onceflow.kernel.errors import ConfigError
from onceflow.kernel.keyspace import (
    GC_FLOOR_FIELD,
    META_PATTERN,
    STAGING_FIELD,
    Keyspace,
    Kind,
    ParsedKey,
    namespace_of_meta,
)
from onceflow.kernel.scopes import PLAN_FIELD, Connect, read_scopes, tag_client
from onceflow.kernel.scripts import scripts_for
from onceflow.kernel.seen_layout import LAYOUT_FIELD, check_layout
from onceflow.operations.gc_report import KEY_KINDS, Garbage, GcPass, Removed
from onceflow.operations.staging import DEFAULT_STAGING_AGE_S, clear_staging, listed_folders

# Buckets of event time a generation is kept past the horizon, in case a clock is a little behind.
SLACK_BUCKETS = 1
DEFAULT_SCAN_COUNT = 1000
DEFAULT_DELETE_BATCH = 500


class GcError(ConfigError):
    """A GC pass cannot run; the message says what to check."""


class NoStateError(GcError):
    """A namespace has no exactly-once state in this Redis: not started yet, or another name."""


def read_meta(client: Any, ks: Keyspace) -> dict[str, str]:
    """A namespace's fixed settings; a clear error when the namespace has no state here.

    A namespace an older Onceflow made in another seen-ID layout is refused too
    (:func:`~onceflow.kernel.seen_layout.check_layout`): its state cannot be read right.
    """
    meta = {k.decode(): v.decode() for k, v in client.hgetall(ks.meta).items()}
    if not meta:
        msg = (
            f"namespace {ks.namespace!r} has no exactly-once state in this Redis (no {ks.meta}): "
            "check the namespace (default: the pipeline's name) and REDIS_URL"
        )
        raise NoStateError(msg)
    has_state = "parallelism" in meta or PLAN_FIELD in meta
    try:
        check_layout(meta.get(LAYOUT_FIELD), has_state, ks.namespace)
    except ConfigError as exc:
        raise GcError(str(exc)) from None
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
    """SCAN in bounded steps, one step's keys at a time, each key once.

    SCAN may return a key more than once (when Redis resizes its table during the scan):
    keys already yielded are left out, so that counts summed over keys (a receiver's
    counters in ``onceflow status``) are not counted twice.
    """
    cursor = 0
    yielded: set[str] = set()
    while True:
        cursor, keys = client.scan(cursor=cursor, match=match, count=count)
        fresh = []
        for raw in keys:
            key = raw.decode() if isinstance(raw, bytes) else raw
            if key not in yielded:
                yielded.add(key)
                fresh.append(key)
        if fresh:
            yield fresh
        if cursor == 0:
            return


def _int(raw: Any, default: int) -> int:
    return int(raw) if raw is not None else default


def collect(
    client: Any,
    namespace: str,
    *,
    dry_run: bool = False,
    horizon: Duration | None = None,
    scan_count: int = DEFAULT_SCAN_COUNT,
    delete_batch: int = DEFAULT_DELETE_BATCH,
    connect: Connect | None = None,
    staging_age_s: float = DEFAULT_STAGING_AGE_S,
) -> GcPass:
    """One GC pass over one namespace (see the module docstring).

    The namespace's own tag and each partition scope (:mod:`onceflow.kernel.scopes`) are
    collected alike, by the same acknowledged batch, threshold and limit; a scope forgets its
    own generations. ``connect`` gives a scope's client (on a Redis Cluster); without it
    ``client`` serves every tag.
    """
    t0 = time.monotonic()
    ks = Keyspace(namespace)
    meta = read_meta(client, ks)
    if not meta.get("bucket_ms", "").isdigit():
        msg = (
            f"namespace {namespace!r} has incomplete settings ({ks.meta} has no bucket_ms): "
            "it was not written by an Onceflow run; GC leaves it alone"
        )
        raise GcError(msg)
    bucket_ms = int(meta["bucket_ms"])
    _settle(client, dry_run)
    acked = acknowledged(client, ks)
    params = read_batch_params(client, ks, acked) if acked >= 0 else None
    following = read_batch_params(client, ks, acked + 1)
    horizon_ms = _horizon(meta, horizon, namespace, params, following)
    watermark = params.watermark if params is not None else 0
    threshold = watermark - horizon_ms - bucket_ms * SLACK_BUCKETS if watermark > 0 else None
    limit = params.generation if params is not None else None
    if threshold is not None and not dry_run:
        # before anything is deleted: later batches never admit older records again (a raised
        # horizon would otherwise admit copies whose seen-IDs are gone)
        _raise_floor(client, ks, threshold)
    garbage = _forget_generations(client, ks, threshold, limit, dry_run)
    result = GcPass(namespace, dry_run, horizon_ms, watermark, acked, threshold, garbage)
    expired_by = params.time_ms if params is not None else None
    forgotten = set(garbage.forgotten)
    for tag in read_scopes(client, ks).keyspaces():
        tagged = tag_client(client, tag, connect)
        tag_garbage = garbage
        if tag.scope is not None:
            _settle(tagged, dry_run)
            if threshold is not None and not dry_run:  # the scope's commits check its own
                _raise_floor(tagged, tag, threshold)
            tag_garbage = _forget_generations(tagged, tag, threshold, limit, dry_run)
            forgotten |= tag_garbage.forgotten
        for keys in scan_steps(tagged, tag.pattern(), scan_count):
            result.scanned += len(keys)
            victims, snapshots, expiries = _classify(tag, keys, tag_garbage, acked)
            for kind, found in victims.items():
                for start in range(0, len(found), delete_batch):
                    _remove(tagged, found[start : start + delete_batch], kind, result, dry_run)
            if snapshots and tag_garbage:
                _trim_snapshots(tagged, snapshots, tag_garbage, result, dry_run)
            if expired_by is not None:
                for parsed in expiries:
                    _expire_state(tagged, tag, parsed, expired_by, delete_batch, result, dry_run)
    result.garbage = Garbage(frozenset(forgotten), garbage.below)
    _clear_staging(meta, staging_age_s, result)
    result.seconds = time.monotonic() - t0
    if not dry_run:
        _record(client, ks, result)
    return result


def _clear_staging(meta: dict[str, str], age_s: float, result: GcPass) -> None:
    """Staged files of killed attempts (see :mod:`onceflow.operations.staging`)."""
    cleared = clear_staging(listed_folders(meta.get(STAGING_FIELD)), age_s, result.dry_run)
    if cleared.files:
        result.removed["staged_files"] = Removed(keys=cleared.files, bytes=cleared.bytes)


def _raise_floor(client: Any, ks: Keyspace, threshold: int) -> None:
    """Raise the GC floor of ``ks``'s hash tag (it only rises; any server will do)."""
    keys, args = script_args.raise_generations(ks.gc, "", {GC_FLOOR_FIELD: threshold})
    scripts_for(client).raise_generations(keys=keys, args=args)


def _settle(client: Any, dry_run: bool) -> None:
    """Before GC writes, a torn transaction a restarted Redis's AOF may end in goes first.

    See :func:`onceflow.dedup.aof.settle_aof`.
    """
    if not dry_run:
        settle_aof(client)


def _forget_generations(
    client: Any, ks: Keyspace, threshold: int | None, limit: int | None, dry_run: bool
) -> Garbage:
    """Forget the generations older than ``limit`` whose newest event time is before ``threshold``.

    ``limit`` is the generation of the last acknowledged batch: every batch that may still
    commit (the acknowledged batch's successors, and their replays) commits into it or a
    newer one, since the dedup time never goes back. A generation at or past it is never
    forgotten, whatever its newest event time, so no commit can land in a generation whose
    keys a pass is deleting.

    Returns what is garbage: the generations forgotten now, and any generation older than
    every one still remembered and older than ``limit`` (leftovers of an earlier pass that
    stopped halfway: nothing commits into those again).
    """
    if threshold is None or limit is None:
        return Garbage(frozenset(), None)
    newest = {int(g): int(ts) for g, ts in client.hgetall(ks.generations).items()}
    old = sorted(g for g, ts in newest.items() if ts < threshold and g < limit)
    forgotten = []
    for g in old:
        keys, args = script_args.forget_generation(ks, g, threshold)
        if dry_run or scripts_for(client).forget_generation(keys=keys, args=args):
            forgotten.append(g)
    remembered = [g for g in newest if g not in forgotten]
    below = min([*remembered, limit])
    return Garbage(frozenset(forgotten), below)


def _horizon(
    meta: dict[str, str],
    horizon: Duration | None,
    namespace: str,
    *batches: BatchParams | None,
) -> int:
    """The longest horizon a batch that may still run uses, or a longer one asked for.

    The last acknowledged batch, the one after it (it may replay) and the pipeline's current
    setting (the next new batch takes it) all count; a shorter ``--horizon`` is refused.
    """
    horizon_ms = max(
        [int(meta.get("horizon_ms", DAY_MS))] + [b.horizon_ms for b in batches if b is not None]
    )
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
    ks: Keyspace, keys: list[str], garbage: Garbage, acked: int
) -> tuple[dict[str, list[str]], list[str], list[ParsedKey]]:
    """Sort one SCAN step's keys.

    Returns keys to unlink by kind, snapshot hashes to trim, and the expiry sets of state
    with a time-to-live.
    """
    victims: dict[str, list[str]] = {kind: [] for kind in KEY_KINDS}
    snapshots = []
    expiries = []
    for key in keys:
        parsed = ks.parse(key)
        if parsed is None:
            continue
        if parsed.kind is Kind.SEEN:
            if parsed.generation is not None and garbage.holds(parsed.generation):
                victims["seen_ids"].append(key)
        elif parsed.kind is Kind.BACKUP:
            if is_garbage(parsed, acked):
                victims["backups"].append(key)
        elif parsed.kind is Kind.BATCH:
            if parsed.batch is not None and parsed.batch < acked:
                victims["batch_params"].append(key)
        elif parsed.kind is Kind.FILTER_SNAPSHOT:
            snapshots.append(key)
        elif parsed.kind is Kind.EXPIRY:
            expiries.append(parsed)
    return victims, snapshots, expiries


def _expire_state(
    client: Any,
    ks: Keyspace,
    parsed: ParsedKey,
    before: int,
    batch: int,
    result: GcPass,
    dry_run: bool,
) -> None:
    """Delete the state of one combine partition whose time-to-live ran out by ``before``."""
    assert parsed.name is not None and parsed.partition is not None
    zkey = ks.timers("expiry", parsed.name, parsed.partition)
    hkey = ks.state(parsed.name, parsed.partition)
    removed = result.removed.setdefault("expired_state", Removed())
    offset = 0
    while True:
        # a dry run deletes nothing, so it pages on; a real pass always reads the front
        members = client.zrangebyscore(zkey, "-inf", before, start=offset, num=batch)
        if not members:
            return
        if dry_run:
            removed.fields += len(members)
            offset += len(members)
            continue
        pipe = client.pipeline(transaction=False)
        for member in members:
            pipe.hstrlen(hkey, member)
        size = sum(int(n or 0) for n in pipe.execute())
        keys, args = script_args.expire_state(hkey, zkey, before, members)
        gone = int(scripts_for(client).expire_state(keys=keys, args=args))
        removed.fields += gone
        removed.bytes += size if gone == len(members) else 0
        if gone == 0:
            return  # all were updated meanwhile: their expiry moved past ``before``


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
    client: Any, keys: list[str], garbage: Garbage, result: GcPass, dry_run: bool
) -> None:
    """Drop snapshot fields of garbage generations (each HDEL is atomic on its key)."""
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.hkeys(key)
    removed = result.removed.setdefault("bloom_snapshots", Removed())
    for key, fields in zip(keys, pipe.execute(), strict=True):
        old = [f for f in (x.decode() for x in fields) if _garbage_field(f, garbage)]
        if not old:
            continue
        pipe = client.pipeline(transaction=False)
        for f in old:
            pipe.hstrlen(key, f)
        removed.bytes += sum(int(n or 0) for n in pipe.execute())
        removed.fields += len(old)
        if not dry_run:
            client.hdel(key, *old)


def _garbage_field(name: str, garbage: Garbage) -> bool:
    """Whether a snapshot hash field holds the filters of a garbage generation."""
    if not name.startswith(GENERATION_FIELD):
        return False
    number = name[len(GENERATION_FIELD) :]
    return number.lstrip("-").isdigit() and garbage.holds(int(number))


def _record(client: Any, ks: Keyspace, result: GcPass) -> None:
    t = result.total
    pipe = client.pipeline(transaction=False)
    pipe.hset(
        ks.gc,
        mapping={
            "last_pass_ms": int(time.time() * 1000),
            "last_threshold_ms": -1 if result.threshold is None else result.threshold,
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
