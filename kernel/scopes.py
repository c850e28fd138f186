"""Partition scopes: where a stage partition's exactly-once state lives.

A stage that follows a key exchange (``spec.exchange``) receives every copy of a record in
the same partition: the exchange routes by key over a parallelism pinned for the life of the
pipeline, and a retried producer replays the same outputs (same IDs, same keys) from its
backup. Each such partition therefore keeps *all* its state under a hash tag of its own,
``of:{<namespace>:<scope>}``: its task token, seen-IDs, Bloom journal and snapshot, counters,
backups, keyed state and timers, the sinks it writes, the generations it committed into, and
a copy of the driver epoch (raised by the first task of a newer driver that claims the
partition, fencing the older driver's tasks from then on). Every Lua call of such a task
touches that one slot, and on a Redis Cluster the partitions of a pipeline spread over the
masters.

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

from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.scripts import scripts_for

SCOPED_FIELD = "scoped_stages"  # meta: JSON list of the stages kept per partition scope
PLAN_FIELD = "plan"  # meta: the physical plan's layout (see onceflow.runtime.pinning)

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


def pin_scopes(
    client: Any, ks: Keyspace, exchange_stages: Iterable[str], parallelism: int, new: bool
) -> Scopes:
    """Fix the scoped stages of a new namespace; keep an existing namespace's.

    An existing namespace with scopes takes on exchange stages a changed plan added (their
    state starts in scopes); one without scopes (made before them) keeps every key in its tag.
    """
    wanted = set(exchange_stages)
    if new:
        client.hsetnx(ks.meta, SCOPED_FIELD, json.dumps(sorted(wanted)))
    raw = client.hget(ks.meta, SCOPED_FIELD)
    if raw is None:
        return Scopes(ks.namespace, frozenset(), parallelism)
    stages = frozenset(json.loads(raw))
    if not wanted <= stages:
        stages = stages | wanted
        client.hset(ks.meta, SCOPED_FIELD, json.dumps(sorted(stages)))
    return Scopes(ks.namespace, stages, parallelism)


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
        scoped = client if connect is None or ks.scope is None else connect(ks.tag)
        out.update(scoped.hgetall(ks.state(node, p)))
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


def merge_generations(client: Any, scopes: Scopes, connect: Connect) -> int:
    """Raise the namespace's generations to the newest event time any scope committed.

    Returns how many generations were raised. Idempotent (a raise never lowers), so a
    replayed batch merges again harmlessly.
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
    args: list[Any] = []
    for g, ts in sorted(newest.items()):
        args += [g, ts]
    home = Keyspace(scopes.namespace)
    return int(scripts_for(client).raise_generations(keys=[home.generations], args=args))
