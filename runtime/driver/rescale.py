"""Change a stopped pipeline's parallelism and keep its state: a rescale.

A stage that follows a key exchange keeps each partition's state under a scope of its own
(:mod:`onceflow.kernel.scopes`), and the exchange sends a key to ``pmod(hash(key), n)``
(:mod:`onceflow.kernel.key_hash`). With another ``n`` a key goes elsewhere, so a rescale moves,
for every such stage, what belongs to a key to the partition the new parallelism sends it to:

* keyed state and its timers (event, processing, expiry) field by field, by their key;
* seen-IDs: an ID does not say its key, so every new partition gets the seen-IDs of all old
  ones (the union; each is garbage when its generation leaves the horizon, as before). Bloom
  filters are not carried: the new partitions' commit counters are set past every old one's,
  with no snapshot and no journal, so each task rebuilds its filters from the seen-IDs first
  (:mod:`onceflow.dedup.trust`) and no filter says "not seen" for an ID it was not shown;
* the generations a partition committed into (the newest of each), the receivers' counters
  (summed, once, into partition 0) and the sinks' last known delivery of a partition that
  stays; task tokens, Bloom snapshots and journals, and acknowledged backups go.

Source stages keep their seen-IDs in the namespace's own tag, one set for every input
partition, so they need no move (and survive a topic that grew partitions).

Only a stopped pipeline with nothing in flight is rescaled: a micro-batch that started and was
not acknowledged must be replayed under the partitions its first attempt had (its backups and
pending deliveries are numbered by them), so it is refused with the way to finish it.

A rescale stopped at any point (kill -9) is finished by the next attempt, ``onceflow rescale``
or a run (the namespace's meta ``rescaling`` says one is under way, and in which phase):

1. *staging* (:mod:`~.rescale_staging`): every new partition's keys are written under staged
   names beside the live ones, each scope marked ready last. Nothing live changes, so an
   attempt cut short here is started over from the live keys (to any parallelism).
2. *switching*: each new partition's scope replaces its live keys by its staged ones in one
   transaction (a scope without its ready mark was switched already); scopes past the new
   parallelism go; last, the namespace's ``parallelism`` and plan change and the record goes.
   An attempt cut short here finishes the switch to the parallelism it staged first.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from onceflow.dedup.config import DedupConfig
from onceflow.dedup.durability import DEFAULT_TIMEOUT_MS, inherit_markers
from onceflow.kernel.errors import ConfigError
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.scopes import (
    PLAN_FIELD,
    Connect,
    Scopes,
    distinct,
    raise_epochs,
    read_scopes,
)
from onceflow.kernel.store import store_for
from onceflow.runtime.driver.rescale_checks import (
    RESCALING_FIELD,
    check,
    release_lock,
    renew_lock,
    take_lock,
    underway,
    wait_for_driver,
)
from onceflow.runtime.driver.rescale_staging import (
    KEPT,
    READY,
    SCAN,
    STAGED,
    Layout,
    clear_staged,
    gather,
    stage_scope,
)

_STAGING, _SWITCHING = "staging", "switching"  # its phases


@dataclass
class RescaleReport:
    """What a rescale did."""

    namespace: str
    before: int
    after: int
    keys: int = 0  # keyed-state entries and timers moved
    seen_ids: int = 0  # distinct seen-IDs copied into every new partition
    seconds: float = 0.0


def rescale(
    client: Any,
    namespace: str,
    parallelism: int,
    *,
    connect: Connect | None = None,
    force: bool = False,
    wait_s: float = 0.0,
    say: Callable[[str], None] | None = None,
) -> RescaleReport:
    """Move a stopped namespace's exchange stages to ``parallelism`` partitions.

    ``connect`` gives the client of a hash tag (a Redis Cluster); without it ``client`` serves
    every tag. A driver of the namespace that still says it runs is waited for up to
    ``wait_s``, then refused unless ``force`` (which also takes over the lock of a rescale
    whose process is gone). ``say`` is told of each step (a line a person can read).
    """
    home = Keyspace(namespace)
    tag = _tag_client(client, connect)
    scopes, record = check(client, home, parallelism, tag)
    report = RescaleReport(namespace, scopes.parallelism, parallelism)
    if scopes.parallelism == parallelism and record is None:
        return report
    tell = say or (lambda _line: None)
    wait_for_driver(client, home, wait_s, force, tell)
    token = take_lock(client, home, force)
    try:
        return _move(client, home, scopes, record, parallelism, tag, report, tell, token)
    finally:
        release_lock(client, home, token)


def _move(  # noqa: PLR0913 - the steps of one rescale share these
    client: Any,
    home: Keyspace,
    scopes: Scopes,
    record: dict[str, Any] | None,
    parallelism: int,
    tag: Connect,
    report: RescaleReport,
    tell: Callable[[str], None],
    token: str,
) -> RescaleReport:
    started = time.monotonic()
    namespace = home.namespace
    reach = max(scopes.parallelism, parallelism, int((record or {}).get("reach", 0)))
    wide = Scopes(namespace, scopes.stages, reach)
    epoch = store_for(client).incr(home.epoch)  # older drivers' tasks can no longer commit
    raise_epochs(wide, epoch, tag)
    target = parallelism
    if record is None or record.get("phase") != _SWITCHING:
        tell(f"rescaling {namespace!r} from {scopes.parallelism} to {parallelism} partitions")
        _set_record(client, home, _STAGING, parallelism, reach)
        _stage_all(client, tag, wide, parallelism, report, tell, token)
        durable(client, wide, tag)  # staged for good before anything live changes
        _set_record(client, home, _SWITCHING, parallelism, reach)
    else:  # cut short while switching: everything is staged; switch the rest first
        target = int(record["target"])
        tell(f"finishing the rescale of {namespace!r} to {target} partitions")
    new = Scopes(namespace, scopes.stages, target)
    added = [ks for ks in new.partition_keyspaces() if ks not in scopes.partition_keyspaces()]
    inherit_markers((home, client), [(ks, tag(ks.tag)) for ks in added])
    for i, ks in enumerate(new.partition_keyspaces()):
        _switch_scope(tag(ks.tag), ks)
        renew_lock(client, home, token)
        tell(f"scope {i + 1} of {len(new.partition_keyspaces())} switched")
    for stage in sorted(scopes.stages):
        for p in range(target, reach):
            _drop_scope(tag, wide.keyspace(stage, p))
    durable(client, wide, tag)  # every scope switched for good before the namespace says so
    _finish(client, home, target)
    report.seconds = time.monotonic() - started
    tell(f"rescaled {namespace!r} to {target} partitions in {report.seconds:.1f} s")
    if target != parallelism:  # the rescale cut short went elsewhere: now to this one
        release_lock(client, home, token)
        return rescale(client, namespace, parallelism, connect=tag, force=True, say=tell)
    return report


def durable(client: Any, wide: Scopes, tag: Connect) -> None:
    """Wait until every master holding the namespace fsynced what it was sent (``WAITAOF``).

    A Redis without ``WAITAOF`` (before 7.2) or without an AOF answers an error: nothing to
    wait for there (its runs are refused or warned about at start, see ``dedup.durability``).
    """
    for ks, master in distinct([(ks, tag(ks.tag)) for ks in wide.keyspaces()]):
        if store_for(master).waitaof(DEFAULT_TIMEOUT_MS) is False:
            msg = (
                f"the Redis holding {ks.tag!r} did not confirm its fsync within "
                f"{DEFAULT_TIMEOUT_MS // 1000} s: the rescale stopped before the next step "
                "(run it again once that Redis answers)"
            )
            raise ConfigError(msg)


def abort(client: Any, namespace: str, *, connect: Connect | None = None) -> bool:
    """Drop a rescale cut short while staging (nothing live had changed); whether there was one.

    One cut short while switching cannot be undone (some scopes are switched): finish it.
    """
    home = Keyspace(namespace)
    record = underway(client, home)
    if record is None:
        return False
    if record.get("phase") == _SWITCHING:
        msg = (
            f"the rescale of namespace {namespace!r} to {record['target']} partitions was cut "
            "short while switching: it cannot be undone, finish it with onceflow rescale "
            f"--namespace {namespace} --parallelism {record['target']}"
        )
        raise ConfigError(msg)
    tag = _tag_client(client, connect)
    token = take_lock(client, home, force=False)
    try:
        stored = read_scopes(client, home)
        wide = Scopes(namespace, stored.stages, scopes_reach(client, home))
        for ks in wide.partition_keyspaces():
            clear_staged(tag, ks)
        cmds = store_for(client).batch()
        cmds.hdel(home.meta, RESCALING_FIELD)
        cmds.execute()
    finally:
        release_lock(client, home, token)
    return True


def scopes_reach(client: Any, home: Keyspace) -> int:
    """How many partition scopes a namespace may have: its parallelism, or a rescale's reach."""
    record = underway(client, home) or {}
    return max(read_scopes(client, home).parallelism, int(record.get("reach", 0)))


def _set_record(client: Any, home: Keyspace, phase: str, target: int, reach: int) -> None:
    record = {"phase": phase, "target": target, "reach": reach}
    store_for(client).hset(home.meta, RESCALING_FIELD, json.dumps(record, sort_keys=True))


def _stage_all(
    client: Any,
    tag: Connect,
    wide: Scopes,
    parallelism: int,
    report: RescaleReport,
    tell: Callable[[str], None],
    token: str,
) -> None:
    """Stage every exchange stage's new partitions beside the live keys (nothing live moves).

    Staged keys of an earlier attempt go first: the live keys are all still the old layout.
    """
    home = Keyspace(wide.namespace)
    base = int(store_for(client).hget(home.meta, "shards") or DedupConfig().shards)
    old = read_scopes(client, home).parallelism
    for stage in sorted(wide.stages):
        for p in range(wide.parallelism):
            clear_staged(tag, wide.keyspace(stage, p))
        move = gather(tag, wide, stage, parallelism, Layout(base, old))
        new = Scopes(wide.namespace, wide.stages, parallelism)
        for p in range(parallelism):
            report.keys += stage_scope(
                tag, new.keyspace(stage, p), p, move, Layout(base, parallelism)
            )
            renew_lock(client, home, token)
            tell(f"stage {stage!r}: partition {p + 1} of {parallelism} staged")
        report.seen_ids += len({rid for ids in move.seen.values() for rid in ids})


def _tag_client(client: Any, connect: Connect | None) -> Connect:
    return connect if connect is not None else (lambda _tag: client)


def _switch_scope(client: Any, ks: Keyspace) -> None:
    """Replace a staged scope's live keys by its staged ones, in one transaction.

    A scope without its ready mark was switched already (or has nothing staged): left as is.
    """
    ready = f"{ks.root}:{READY}"
    store = store_for(client)
    if not store.exists(ready):
        return
    prefix = f"{ks.root}:{STAGED}:"
    staged, live = [], []
    for raw in store_for(client).scan_iter(ks.pattern(), SCAN):
        name = raw.decode()
        if name.startswith(prefix):
            staged.append(name)
        elif (q := ks.parse(name)) is not None and q.kind not in KEPT:
            live.append(name)
    cmds = store.transaction()
    for i in range(0, len(live), SCAN):
        cmds.unlink(*live[i : i + SCAN])
    for name in staged:
        cmds.rename(name, f"{ks.root}:{name[len(prefix) :]}")
    cmds.delete(ready)
    cmds.execute()


def _drop_scope(tag: Connect, ks: Keyspace) -> None:
    """Delete a partition scope the new parallelism no longer has (its keys moved)."""
    client = tag(ks.tag)
    keys = [k.decode() for k in store_for(client).scan_iter(ks.pattern(), SCAN)]
    for i in range(0, len(keys), SCAN):
        store_for(client).delete(*keys[i : i + SCAN])


def _finish(client: Any, home: Keyspace, parallelism: int) -> None:
    """The namespace's parallelism (and its plan's) becomes the new one; the rescale ends."""
    raw = store_for(client).hget(home.meta, PLAN_FIELD)
    cmds = store_for(client).transaction()
    cmds.hset(home.meta, "parallelism", str(parallelism))
    if raw is not None:
        plan = json.loads(raw)
        plan["parallelism"] = parallelism
        cmds.hset(home.meta, PLAN_FIELD, json.dumps(plan, sort_keys=True))
    cmds.hdel(home.meta, RESCALING_FIELD)
    cmds.execute()


def print_step(line: str) -> None:
    """A rescale's step, on standard error (a run's output stays the pipeline's)."""
    print(line, file=sys.stderr, flush=True)
