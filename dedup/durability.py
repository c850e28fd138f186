"""Waiting until a micro-batch's writes are durable, before Spark commits the batch.

Every commit of a batch returns once Redis applied it; that is not yet on disk (with
``appendfsync everysec`` the AOF is fsynced once a second) nor on a replica (replication is
asynchronous). If Spark committed the batch and Redis then lost its last writes (a machine
crash, a failover to a replica that lagged), the batch's seen-marks and state would be gone
while Spark would never replay it: silent loss or duplicates. So at the end of every batch
the driver writes a marker and waits, on that same connection, until Redis says every write
before it is durable (on a Redis Cluster, on every master holding one of the pipeline's
partition scopes, see :mod:`onceflow.kernel.scopes`):

* ``WAITAOF 1 0`` (Redis 7.2 and later): fsynced to the local AOF. With ``appendfsync
  always`` every write already is; on an older Redis with ``everysec`` this cannot be asked,
  and a host crash may roll back up to a second of commits (said once at start);
* ``WAIT n`` when replicas are required: acknowledged by ``n`` replicas.

Redis serializes writes, so a marker written after the batch's tasks finished covers them
all. If the wait times out the batch is not committed (the run stops with the reason, and a
restart replays the batch): a clear stop, never a silent loss.

A failover (the master dies and a replica takes over, on Redis Cluster or under Sentinel) may
lose the writes the old master had not yet passed on, while the clients carry on with the new
master. ``WAIT`` on the new master cannot tell. So when replicas are required the driver
notes each master's replication ID when a batch starts (:func:`replication_id`) and again with
the end-of-batch wait: a promoted replica has a new one. If it changed, the batch is not
committed and the run stops saying so; the restart replays the batch, redoing whatever was
lost (committed parts are recognised and skipped). A sink's delivery is also held until
its pending record reached the replicas (:func:`onceflow.dedup.delivery.prepare`), so a
failover never forgets a delivery that became visible.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from onceflow.kernel.errors import ServiceError
from onceflow.kernel.keyspace import Keyspace

WAITAOF_VERSION = (7, 2)
DEFAULT_TIMEOUT_MS = 10_000
MARK_FIELD = "durable"


@dataclass(frozen=True)
class Durability:
    """What a pipeline waits for at the end of each micro-batch."""

    waitaof: bool  # ask for the local fsync (the server supports it and fsync is not "always")
    replicas: int  # replicas that must acknowledge (0: none)
    timeout_ms: int = DEFAULT_TIMEOUT_MS
    auto: bool = False  # replicas: one if the master has any when a batch starts, else none

    def for_batch(self, targets: Sequence[tuple[str, Any]]) -> BatchDurability:
        """What a starting batch waits for, per hash tag, and each tag's master now.

        ``targets`` pairs each hash tag the batch writes (the namespace's first, then its
        partition scopes) with its client. Each tag's master is identified by its replication
        ID (one INFO per client), so the end of the batch waits once per master. In the
        automatic setting each master is waited on for one replica if it has one now (after
        a failover the promoted master has none until the old node returns).
        """
        if not self.waitaof and not self.auto and not self.replicas:
            return BatchDurability({}, None)
        infos: dict[int, Any] = {}
        replicas: dict[str, int] = {}
        masters: dict[str, str] = {}
        for tag, client in targets:
            if id(client) not in infos:
                infos[id(client)] = client.info("replication")
            info = infos[id(client)]
            wanted = self.replicas
            if self.auto:
                wanted = 1 if int(info.get("connected_slaves", 0)) > 0 else 0
            replicas[tag] = wanted
            masters[tag] = str(info.get("master_replid", ""))
        checked = {tag: replid for tag, replid in masters.items() if replicas[tag]}
        return BatchDurability(replicas, checked or None, masters)

    def describe(self) -> str:
        """One line for the run's start."""
        parts = []
        if self.waitaof:
            parts.append("the AOF fsync (WAITAOF)")
        if self.replicas:
            parts.append(f"{self.replicas} replica(s) (WAIT)")
        elif self.auto:
            parts.append("one replica on each master that has one (WAIT)")
        return " and ".join(parts) if parts else "nothing more than Redis's reply"


@dataclass(frozen=True)
class BatchDurability:
    """One batch's replicas to wait for, and its master's replication ID when it started.

    With replicas, a change of master during the batch (a failover) is a clear stop
    (:func:`wait_durable`, and tasks check it when they open: :func:`check_master`).
    """

    replicas: Mapping[str, int]  # hash tag -> replicas its master's writes must reach
    started_on: Mapping[str, str] | None  # hash tag -> its master's replication ID (checked)
    masters: Mapping[str, str] = field(default_factory=dict)  # every tag -> its master's ID

    def replicas_of(self, tag: str) -> int:
        """Replicas to wait for on the master of ``tag``."""
        return self.replicas.get(tag, 0)


def _version(client: Any) -> tuple[int, ...]:
    raw = str(client.info("server").get("redis_version", "0"))
    return tuple(int(p) for p in raw.split(".")[:2] if p.isdigit())


def plan_durability(clients: Sequence[Any], replicas: int | None, timeout_ms: int) -> Durability:
    """What to wait for: the local fsync when any master needs it asked, and replicas.

    ``clients`` reach every master the pipeline writes to. ``replicas`` None means: one, on
    each master that has a replica connected when a batch starts.
    """
    waitaof = any(_needs_waitaof(c) for c in clients)
    if replicas is None:
        return Durability(waitaof, 0, timeout_ms, auto=True)
    return Durability(waitaof, replicas, timeout_ms)


def _needs_waitaof(client: Any) -> bool:
    """Whether a master's AOF is on without ``appendfsync always`` and it can confirm fsyncs."""
    info = client.info("persistence")
    try:
        fsync = str(client.config_get("appendfsync").get("appendfsync"))
    except Exception:  # noqa: BLE001 - managed Redis often forbids CONFIG
        fsync = "unknown"
    waitaof = bool(info.get("aof_enabled")) and fsync != "always"
    return waitaof and _version(client) >= WAITAOF_VERSION


def cannot_fsync_warning(clients: Sequence[Any]) -> str | None:
    """A warning when per-batch fsync cannot be confirmed (older Redis with everysec)."""
    for client in clients:
        try:
            fsync = str(client.config_get("appendfsync").get("appendfsync"))
        except Exception:  # noqa: BLE001
            continue
        if fsync == "everysec" and _version(client) < WAITAOF_VERSION:
            return (
                "Redis before 7.2 cannot confirm that a batch's writes were fsynced (WAITAOF); "
                "with appendfsync everysec a host crash may roll back up to a second of "
                "commits. Use appendfsync always, or Redis 7.2+, for that guarantee"
            )
    return None


def replication_id(client: Any) -> str:
    """The master's replication ID: a replica promoted to master starts a new one."""
    return str(client.info("replication").get("master_replid", ""))


class FailoverError(ServiceError):
    """Redis failed over while a batch ran: the batch is not committed (a restart replays it)."""


def failover_message(batch: int) -> str:
    """What a run says when Redis failed over during a batch."""
    return (
        f"Redis failed over during micro-batch {batch} (a replica took over from the "
        "master): writes the old master had not passed on may be lost, so the batch is not "
        "committed. Run the pipeline again: it replays the batch and redoes what was lost"
    )


def check_master(client: Any, batch: int, started_on: str | None) -> None:
    """Raise :class:`FailoverError` if the master changed since the batch started."""
    if started_on is not None and replication_id(client) != started_on:
        raise FailoverError(failover_message(batch))


def wait_durable(
    targets: Sequence[tuple[Keyspace, Any]],
    batch: int,
    durability: Durability,
    this_batch: BatchDurability | None = None,
) -> None:
    """Block until every write so far is durable as ``durability`` asks; raise if it is not.

    ``targets`` pairs a keyspace with its client: tags whose master was the same when the
    batch started (``this_batch.masters``) share one marker and wait (Redis replicates and
    fsyncs in order, so a marker written after the batch's tasks finished covers them all).
    ``this_batch`` (from :meth:`Durability.for_batch` when the batch started) says how many
    replicas to wait for and each master's replication ID then: if a master now has another,
    it failed over during the batch (see the module docstring).
    """
    masters = None if this_batch is None else this_batch.started_on
    groups: dict[str, list[tuple[Keyspace, Any]]] = {}  # master -> its tags
    for ks, client in targets:
        master = this_batch.masters.get(ks.tag) if this_batch is not None else None
        groups.setdefault(master or f"client-{id(client)}", []).append((ks, client))
    for group in groups.values():  # one marker and wait per master: it covers all its writes
        ks, client = group[0]
        replicas = durability.replicas
        if this_batch is not None:
            replicas = max(this_batch.replicas_of(k.tag) for k, _ in group)
        if durability.waitaof or replicas:
            _wait_one(client, ks, batch, durability, replicas, masters)


def _wait_one(
    client: Any,
    ks: Keyspace,
    batch: int,
    durability: Durability,
    replicas: int,
    masters: Mapping[str, str] | None,
) -> None:
    started_on = None if masters is None else masters.get(ks.tag)
    pipe = client.pipeline(transaction=False)  # one connection: the marker and the waits
    if ks.scope is None:
        pipe.hset(ks.batch(batch), MARK_FIELD, "1")
    else:  # a partition scope keeps no batch hashes: its clock notes the last batch waited on
        pipe.hset(ks.clock, MARK_FIELD, str(batch))
    if durability.waitaof:
        pipe.execute_command("WAITAOF", 1, 0, durability.timeout_ms)
    if replicas:
        pipe.execute_command("WAIT", replicas, durability.timeout_ms)
    if started_on is not None:
        pipe.info("replication")
    replies = pipe.execute()
    if started_on is not None and str(replies[-1].get("master_replid", "")) != started_on:
        raise FailoverError(failover_message(batch))
    at = 1
    if durability.waitaof:
        local = replies[at][0] if isinstance(replies[at], list | tuple) else replies[at]
        at += 1
        if int(local) < 1:
            msg = (
                f"Redis did not confirm the fsync of micro-batch {batch}'s writes within "
                f"{durability.timeout_ms} ms; the batch is not committed (a restart replays it)"
            )
            raise ServiceError(msg)
    if replicas:
        acked = int(replies[at])
        if acked < replicas:
            msg = (
                f"only {acked} of {replicas} Redis replica(s) acknowledged "
                f"micro-batch {batch}'s writes within {durability.timeout_ms} ms; the batch is "
                "not committed (a restart replays it). Check the replicas, or lower the "
                "number required (--redis-wait-replicas)"
            )
            raise ServiceError(msg)
