"""Partition scopes: where a stage partition's exactly-once state lives.

A stage that follows a key exchange (``spec.exchange``) receives every copy of a record in
the same partition: the exchange routes by key over a parallelism pinned for the life of the
pipeline, and a retried producer replays the same outputs (same IDs, same keys) from its
backup. Each such partition therefore keeps *all* its state under a hash tag of its own,
``of:{<namespace>:<scope>}``: its task token, seen-IDs, Bloom journal and snapshot, counters,
backups, keyed state and timers, the sinks it writes, the generations it committed into, and
a copy of the driver epoch (set by each driver when it starts, before its first batch, so a
scope fences an older driver's tasks at once, as the namespace's epoch does). Every Lua call
of such a task touches that one slot, and on a Redis Cluster the partitions of a pipeline
spread over the masters.

Source stages (and stages reading them without an exchange) stay in the namespace's own tag:
copies of an input record may arrive in any of their partitions (an upstream producer's
re-send lands on another Kafka partition), so their seen-IDs must be one set. The
pipeline-wide keys (meta, epoch, batch parameters, clock, source lanes, generations, GC) stay
there too. The driver folds each scope's generations into the namespace's after every
micro-batch (:func:`merge_generations`), before Spark commits it: the next batch's live
generations, and GC's limit, are computed from the namespace's.

Which stages are scoped is fixed when a namespace is created (meta field ``scoped_stages``);
a namespace created by an Onceflow without scopes keeps every key in its own tag.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from onceflow.kernel import script_args
from onceflow.kernel.errors import ConfigError
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.scripts import scripts_for

SCOPED_FIELD = "scoped_stages"  # meta: JSON list of the stages kept per partition scope
PLAN_FIELD = "plan"  # meta: the physical plan's layout (see onceflow.runtime.driver.pinning)

# A client for a hash tag (on one Redis, the same client for every tag).
Connect = Callable[[str], Any]


def scope_name(stage: str, partition: int) -> str:
    """The scope of one stage partition: a digest of the stage's name, and the partition.

    Stage names may hold any character but '/', braces included, which a hash tag cannot; the
    keys inside the scope still name the stage in full.
    """
    digest = hashlib.sha1(stage.encode(), usedforsecurity=False).hexdigest()[:10]
    return f"{digest}.{partition}"


@dataclass(frozen=True)
class Scopes:
    """Which stages of a namespace keep their state per partition scope."""

    namespace: str
    stages: frozenset[str] = frozenset()
    parallelism: int = 0

    def keyspace(self, stage: str, partition: int) -> Keyspace:
        """The keys of one stage partition: its scope, or the namespace's own tag."""
        if stage in self.stages:
            return Keyspace(self.namespace, scope_name(stage, partition))
        return Keyspace(self.namespace)

    def partition_keyspaces(self) -> list[Keyspace]:
        """Every partition scope of the namespace, by stage then partition."""
        stages = sorted(self.stages)
        return [self.keyspace(stage, p) for stage in stages for p in range(self.parallelism)]

    def keyspaces(self) -> list[Keyspace]:
        """The namespace's own tag, then every partition scope."""
        return [Keyspace(self.namespace), *self.partition_keyspaces()]


def read_scopes(client: Any, ks: Keyspace) -> Scopes:
    """A namespace's scopes, from its meta hash (none for a namespace created without)."""
    raw, parallelism = client.hmget(ks.meta, [SCOPED_FIELD, "parallelism"])
    stages = frozenset(json.loads(raw)) if raw else frozenset()
    return Scopes(ks.namespace, stages, int(parallelism or 0))


def stored_stages(client: Any, ks: Keyspace) -> frozenset[str]:
    """The stages of the plan stored with a namespace (none for a new one)."""
    raw = client.hget(ks.meta, PLAN_FIELD)
    return frozenset(json.loads(raw).get("stages", {})) if raw else frozenset()


def pin_scopes(
    client: Any,
    ks: Keyspace,
    exchange_stages: Iterable[str],
    stages: Iterable[str],
    previous: frozenset[str],
    parallelism: int,
    new: bool,
    on_added: Callable[[list[Keyspace]], None] | None = None,
) -> Scopes:
    """Fix the scoped stages of a new namespace; keep an existing namespace's.

    ``stages`` are the plan's, ``previous`` those of the plan stored before this run (they
    differ after ``--accept-plan-change``). A stage new to the plan that follows an exchange
    is scoped. A stage whose place changed (it follows an exchange now and did not, or the
    other way round) is refused: its state would be in the wrong tag, and its copies no
    longer all reach one partition. A namespace made before scopes existed keeps every key in
    its own tag. ``on_added`` is called with the partition scopes an existing namespace
    gains (stages new to its plan), before the namespace lists them.
    """
    wanted, present = set(exchange_stages), set(stages)
    if new:
        client.hsetnx(ks.meta, SCOPED_FIELD, json.dumps(sorted(wanted)))
    raw = client.hget(ks.meta, SCOPED_FIELD)
    if raw is None:
        return Scopes(ks.namespace, frozenset(), parallelism)
    stored = frozenset(json.loads(raw))
    moved = sorted((stored & present) - wanted) + sorted((wanted - stored) & previous)
    if moved:
        msg = (
            f"stage(s) {', '.join(map(repr, moved))} of namespace {ks.namespace!r} now "
            "follow a key exchange and did not before, or the other way round: their stored "
            "state is laid out for the old place. Keep the old plan, or start over with "
            f"onceflow reset --namespace {ks.namespace} --checkpoint CHECKPOINT --yes (or "
            "rename the pipeline: its name is its namespace)"
        )
        raise ConfigError(msg)
    if not wanted <= stored:  # exchange stages new to the plan
        if on_added is not None:
            added = Scopes(ks.namespace, frozenset(wanted - stored), parallelism)
            on_added(added.partition_keyspaces())
        stored = stored | wanted
        client.hset(ks.meta, SCOPED_FIELD, json.dumps(sorted(stored)))
    return Scopes(ks.namespace, stored, parallelism)


def tag_client(client: Any, ks: Keyspace, connect: Connect | None) -> Any:
    """The client of ``ks``'s hash tag: ``client`` for the namespace's, else ``connect``'s.

    Without ``connect`` one Redis serves every tag; on a Redis Cluster that would read a
    partition scope on the namespace's master and find nothing, so it is refused.
    """
    if ks.scope is None:
        return client
    if connect is not None:
        return connect(ks.tag)
    from onceflow.kernel.slots import serves_one_slot

    if serves_one_slot(client):
        msg = (
            f"{ks.tag!r} is a partition scope of a Redis Cluster: pass connect= (the client "
            "of each hash tag) to read it; this is an Onceflow bug"
        )
        raise ConfigError(msg)
    return client


def node_keyspaces(client: Any, namespace: str, node: str) -> list[Keyspace]:
    """Where a stateful node keeps its state, one keyspace per partition (by the stored plan).

    For readers outside a run (status pages, tests, demos) that know a node by name.
    """
    home = Keyspace(namespace)
    scopes = read_scopes(client, home)
    raw = client.hget(home.meta, PLAN_FIELD)
    stages = json.loads(raw).get("stages", {}) if raw else {}
    stage = next((name for name, nodes in stages.items() if node in nodes), node)
    return [scopes.keyspace(stage, p) for p in range(max(scopes.parallelism, 1))]


def node_state(
    client: Any, namespace: str, node: str, connect: Connect | None = None
) -> dict[bytes, bytes]:
    """Every partition's stored state of a stateful node: encoded key -> encoded value."""
    out: dict[bytes, bytes] = {}
    for p, ks in enumerate(node_keyspaces(client, namespace, node)):
        out.update(tag_client(client, ks, connect).hgetall(ks.state(node, p)))
    return out


def distinct(targets: Iterable[tuple[Keyspace, Any]]) -> list[tuple[Keyspace, Any]]:
    """The first ``(keyspace, client)`` of each client: on one Redis, the first only."""
    seen: set[int] = set()
    out = []
    for ks, client in targets:
        if id(client) not in seen:
            seen.add(id(client))
            out.append((ks, client))
    return out


def raise_epochs(scopes: Scopes, epoch: int, connect: Connect) -> None:
    """Copy a starting driver's epoch into every partition scope (see ``RAISE_EPOCH``).

    Raises :class:`~onceflow.kernel.errors.ConfigError` when a scope holds a newer epoch than
    the namespace's: state left by another run (a reset that did not finish, or a namespace
    whose pipeline-wide keys were deleted by hand), which this run must not mix with its own.
    """
    for ks in scopes.partition_keyspaces():
        client = connect(ks.tag)
        keys, args = script_args.raise_epoch(ks, epoch)
        now = int(scripts_for(client).raise_epoch(keys=keys, args=args))
        if now > epoch:
            msg = (
                f"partition scope {ks.tag!r} holds driver epoch {now}, newer than namespace "
                f"{scopes.namespace!r}'s ({epoch}): it is state left by another run. Start "
                f"over with onceflow reset --namespace {scopes.namespace} --checkpoint "
                "CHECKPOINT --yes, or rename the pipeline (its name is its namespace)"
            )
            raise ConfigError(msg)


def merge_generations(client: Any, scopes: Scopes, connect: Connect, server: str = "") -> int:
    """Raise the namespace's generations to the newest event time any scope committed.

    Returns how many generations were raised. Idempotent (a raise never lowers), so a
    replayed batch merges again harmlessly. ``server``: the run id the batch started on
    (:mod:`onceflow.dedup.durability`); if the namespace's server changed since, nothing is
    written and -1 is returned.
    """
    partitions = scopes.partition_keyspaces()
    if not partitions:
        return 0
    newest: dict[bytes, int] = {}
    by_client: dict[int, tuple[Any, list[Keyspace]]] = {}
    for ks in partitions:
        scoped = connect(ks.tag)
        by_client.setdefault(id(scoped), (scoped, []))[1].append(ks)
    for scoped, group in by_client.values():
        pipe = scoped.pipeline(transaction=False)
        for ks in group:
            pipe.hgetall(ks.generations)
        for reply in pipe.execute():
            for g, ts in reply.items():
                newest[g] = max(newest.get(g, -1), int(ts))
    if not newest:
        return 0
    home = Keyspace(scopes.namespace)
    keys, args = script_args.raise_generations(
        home.generations, server, dict(sorted(newest.items()))
    )
    return int(scripts_for(client).raise_generations(keys=keys, args=args))
