"""A rescale's first phase: what an exchange stage's partitions hold, staged for new ones.

See :mod:`onceflow.runtime.driver.rescale`. :func:`gather` reads every live partition scope of
a stage (at the namespace's parallelism) and sorts what it holds by the partition the new
parallelism sends each key to; :func:`stage_scope` writes one new partition's keys under
*staged* names in the same hash tag (``of:{<tag>}:rs:<live name>``), and marks the scope ready
last. Nothing live is touched here: a rescale cut short while staging starts again from the
live keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from onceflow.dedup.config import DedupConfig
from onceflow.kernel.errors import ConfigError
from onceflow.kernel.key_hash import exchange_partition
from onceflow.kernel.keyspace import TIMER_KINDS, Keyspace, Kind, ParsedKey
from onceflow.kernel.scopes import Connect, Scopes
from onceflow.kernel.seen_layout import seen_field, seen_id, shard_of
from onceflow.kernel.store import Batch, store_for

STAGED = "rs"  # staged keys of a scope: of:{<tag>}:rs:<the live key's name after the tag>
READY = "rs-ready"  # a scope staged whole (deleted when it is switched)
SCAN = 1000
_WRITE_STEP = 2000  # fields per HSET/ZADD
KEYED = {Kind.STATE, *TIMER_KINDS.values()}  # moved field by field, by key
KEPT = {Kind.EPOCH, Kind.CLOCK}  # a scope's fencing epoch and durability marker stay
_DROPPED = {Kind.TOKEN, Kind.FILTER_JOURNAL, Kind.FILTER_SNAPSHOT, Kind.BACKUP}
_CARRIED = {Kind.SEEN, Kind.STATS, Kind.GENERATIONS, Kind.PENDING, Kind.FILTER_SEQ, Kind.GC}
HANDLED = KEYED | KEPT | _DROPPED | _CARRIED  # every kind a partition scope may hold
_TIMER_WORDS = {kind: word for word, kind in TIMER_KINDS.items()}


@dataclass
class StageMove:
    """What one exchange stage's partitions hold, gathered from its live scopes."""

    keyed: dict[tuple[Kind, str], dict[bytes, Any]] = field(default_factory=dict)
    seen: dict[tuple[str, int], dict[bytes, bytes]] = field(default_factory=dict)  # IDs: marks
    filter_seq: dict[str, int] = field(default_factory=dict)
    stats: dict[str, dict[str, int]] = field(default_factory=dict)
    generations: dict[bytes, int] = field(default_factory=dict)
    gc: dict[bytes, int] = field(default_factory=dict)  # a scope's GC floor (numeric fields)
    last_delivery: dict[tuple[str, int], bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class Layout:
    """What a scope's seen-ID shards depend on: the namespace's shards and parallelism."""

    shards: int  # the namespace's (meta ``shards``); a scope has its share (for_scope)
    parallelism: int  # the namespace's stored parallelism (of a scope not yet rewritten)


def scope_shards(layout: Layout, parallelism: int) -> int:
    """The seen-ID shards of one partition scope at ``parallelism``."""
    return DedupConfig(shards=layout.shards).for_scope(parallelism).shards


def gather(tag: Connect, wide: Scopes, stage: str, parallelism: int, layout: Layout) -> StageMove:
    """Everything ``stage``'s live scopes hold, by destination partition.

    A scope's seen-IDs are stored in its share of the shards, which depends on the
    namespace's parallelism (``layout``): they are read back as whole IDs.
    """
    move = StageMove()
    for p in range(layout.parallelism):  # the live scopes (past them: staged keys at most)
        ks = wide.keyspace(stage, p)
        client = tag(ks.tag)
        shards = scope_shards(layout, layout.parallelism)
        keys = [k.decode() for k in store_for(client).scan_iter(ks.pattern(), SCAN)]
        parsed = [(k, ks.parse(k)) for k in keys]
        cmds = store_for(client).batch()
        wanted = [(k, q) for k, q in parsed if q is not None and _read(cmds, k, q)]
        for (_key, q), reply in zip(wanted, cmds.execute() if wanted else [], strict=True):
            _take(move, q, reply, p, parallelism, shards)
    return move


def _read(cmds: Batch, key: str, q: ParsedKey) -> bool:
    """Queue the read of a key worth carrying; False for keys that stay or go."""
    if q.kind in (Kind.STATE, Kind.SEEN, Kind.STATS, Kind.GENERATIONS, Kind.PENDING, Kind.GC):
        cmds.hgetall(key)
    elif q.kind in KEYED:
        cmds.zrange_all(key)
    elif q.kind is Kind.FILTER_SEQ:
        cmds.get(key)
    elif q.kind in KEPT or q.kind in _DROPPED:
        return False
    else:
        msg = f"a rescale does not know what to do with {key!r}; this is an Onceflow bug"
        raise ConfigError(msg)
    return True


def _take(  # noqa: PLR0913 - one key's reply and where it came from
    move: StageMove, q: ParsedKey, reply: Any, p: int, parallelism: int, shards: int
) -> None:
    """Add one key's contents to ``move`` (``shards``: of the scope the key is in)."""
    if q.kind in KEYED:
        pairs = reply.items() if isinstance(reply, dict) else reply
        target = move.keyed
        for member, value in pairs:
            dest = (q.kind, f"{q.name}\0{exchange_partition(member, parallelism)}")
            kept = target.setdefault(dest, {}).setdefault(member, value)
            if kept != value and q.kind is Kind.STATE:
                msg = f"key {member!r} of {q.name!r} holds two states; this is an Onceflow bug"
                raise ConfigError(msg)
    elif q.kind is Kind.SEEN:
        assert q.name is not None and q.generation is not None and q.shard is not None
        ids = move.seen.setdefault((q.name, q.generation), {})
        for f, mark in reply.items():
            ids.setdefault(seen_id(f, q.shard, shards), mark)
    elif q.kind is Kind.FILTER_SEQ:
        name = str(q.name)
        move.filter_seq[name] = max(move.filter_seq.get(name, 0), int(reply or 0))
    elif q.kind in (Kind.STATS, Kind.GENERATIONS, Kind.GC):
        _take_numbers(move, q, reply)
    elif q.kind is Kind.PENDING:
        _take_pending(move, q, reply, p)


def _take_numbers(move: StageMove, q: ParsedKey, reply: dict[bytes, bytes]) -> None:
    """Counters add up; generations keep their newest event time; GC floors their highest."""
    numbers = {f: int(v) for f, v in reply.items() if v.lstrip(b"-").isdigit()}
    if q.kind is Kind.STATS:
        counters = move.stats.setdefault(str(q.name), {})
        for f, n in numbers.items():
            counters[f.decode()] = counters.get(f.decode(), 0) + n
        return
    kept = move.generations if q.kind is Kind.GENERATIONS else move.gc
    for f, n in numbers.items():
        kept[f] = max(kept.get(f, n), n)


def _take_pending(move: StageMove, q: ParsedKey, reply: dict[bytes, bytes], p: int) -> None:
    if set(reply) - {b"last"}:
        msg = (
            f"sink {q.name!r} of partition {p} has a delivery pending: a micro-batch did not "
            "finish. Run the pipeline once more with its old parallelism and "
            "--stop-after-batches 1, then rescale"
        )
        raise ConfigError(msg)
    if b"last" in reply:
        move.last_delivery[(str(q.name), p)] = reply[b"last"]


def _staged(ks: Keyspace, live: str) -> str:
    """The staged name of a live key of ``ks`` (same hash tag: a rename moves it)."""
    return f"{ks.root}:{STAGED}:{live[len(ks.root) + 1 :]}"


def stage_scope(tag: Connect, ks: Keyspace, p: int, move: StageMove, layout: Layout) -> int:
    """Stage one new partition's scope whole; return the keyed entries it holds.

    ``layout.parallelism`` here is the new one: the scope's seen-IDs go to its share of the
    shards at that parallelism.
    """
    client = tag(ks.tag)
    shards = scope_shards(layout, layout.parallelism)
    cmds = store_for(client).batch()
    moved = 0
    for (kind, name_p), members in move.keyed.items():
        name, _, dest = name_p.partition("\0")
        if int(dest) != p or not members:
            continue
        moved += len(members)
        word = _TIMER_WORDS.get(kind)
        live = ks.state(name, p) if word is None else ks.timers(word, name, p)
        _write_members(cmds, _staged(ks, live), kind, members)
    for (receiver, generation), ids in move.seen.items():
        by_shard: dict[int, dict[bytes, bytes]] = {}
        for rid, mark in ids.items():
            by_shard.setdefault(shard_of(rid, shards), {})[seen_field(rid, shards)] = mark
        for shard, fields in by_shard.items():
            live = ks.seen(receiver, generation, shard)
            _write_members(cmds, _staged(ks, live), Kind.SEEN, fields)
    for receiver, seq in move.filter_seq.items():  # past every old count: filters rebuild
        cmds.set(_staged(ks, ks.filter_seq(receiver)), seq + 1)
    for receiver, counters in move.stats.items() if p == 0 else ():
        if counters:
            cmds.hset_many(_staged(ks, ks.stats(receiver)), counters)
    if move.generations:
        cmds.hset_many(_staged(ks, ks.generations), move.generations)
    if move.gc:
        cmds.hset_many(_staged(ks, ks.gc), move.gc)
    for (sink, partition), last in move.last_delivery.items():
        if partition == p:
            cmds.hset(_staged(ks, ks.pending(sink, p)), b"last", last)
    cmds.set(f"{ks.root}:{READY}", "1")  # last: the scope is staged whole
    cmds.execute()
    return moved


def clear_staged(tag: Connect, ks: Keyspace) -> None:
    """Delete what an earlier attempt staged in ``ks``."""
    client = tag(ks.tag)
    staged = store_for(client).scan_iter(f"{ks.root}:{STAGED}:*", SCAN)
    keys = [*(k.decode() for k in staged), f"{ks.root}:{READY}"]
    for i in range(0, len(keys), SCAN):
        store_for(client).delete(*keys[i : i + SCAN])


def _write_members(cmds: Batch, key: str, kind: Kind, members: dict[bytes, Any]) -> None:
    items = list(members.items())
    for i in range(0, len(items), _WRITE_STEP):
        step = dict(items[i : i + _WRITE_STEP])
        if kind in (Kind.STATE, Kind.SEEN):
            cmds.hset_many(key, step)
        else:
            cmds.zadd(key, step)
