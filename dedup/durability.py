"""Durable before visible: what Redis must confirm before Spark or Kafka commits anything.

Every commit of a batch returns once Redis applied it; that is not yet on disk (with
``appendfsync everysec`` the AOF is fsynced once a second) nor on a replica (replication is
asynchronous). Two things leave Onceflow's hands: Spark's commit of a micro-batch (it is never
replayed again) and a sink's delivery (a Kafka transaction, once committed, is visible). Both
must only happen once Redis can no longer lose the writes they rest on, so the driver (at the
end of every batch) and a task (before a sink makes a delivery visible,
:func:`onceflow.dedup.delivery.prepare`) write and then wait, on the same connection, until
Redis says every write before is durable (on a Redis Cluster, on every master holding one of
the pipeline's hash tags, see :mod:`onceflow.kernel.scopes`):

* ``WAITAOF 1 0`` (Redis 7.2 and later): fsynced to the local AOF. With ``appendfsync
  always`` every acknowledged write already is. It answers at the next periodic fsync (up to
  a second), so it is asked once per micro-batch: the sinks deliver after the driver's wait
  (``onceflow.runtime.task.deferred``). Redis before 7.2 with ``everysec`` cannot be
  asked: such a Redis is refused (:func:`plan_durability`) unless replicas are waited for or
  the user accepts the risk (``--allow-unconfirmed-fsync``, :data:`UNCONFIRMED_WARNING`);
* ``WAIT n`` when replicas are required: acknowledged by ``n`` replicas.

**A torn transaction in the AOF** (a host crash cutting a script's block): before anything
writes a script on a server that has not rewritten its AOF since it started, it is settled
(:mod:`onceflow.dedup.aof`); every batch starts on settled servers
(:meth:`Durability.for_batch`).

Redis serializes writes and its AOF is a prefix of them, so a marker written after the
batch's tasks finished covers them all; the marker (field ``durable`` of every hash tag's
clock) is the last micro-batch the driver saw durable. If the wait times out the batch is not
committed: a clear stop, never a silent loss.

**A server that goes back.** Whatever was not confirmed can still be lost: a host crash
loses the AOF's unsynced tail, a failover the writes the old master had not passed on. What
is left is then a prefix of what was written, and the batch in flight must be run again from
it; nothing may be written on top of it by anyone who wrote before. So each batch notes every
master's *run id* (``INFO server``: new at each start of the server process, and another
process's after a failover) when it starts (:meth:`Durability.for_batch`); every script that
writes a task's work checks it (:data:`onceflow.kernel.scripts.FENCE`) and the end-of-batch
wait checks it again. A changed server fails the batch with :class:`ServerChangedError`
(tasks' writes after the change are refused, so the state stays a prefix), and the driver
runs the batch again on the new server. Before it does, and when a run starts, every tag's
marker must be at least the last batch Spark committed (:func:`check_markers`): a marker
behind it means Redis lost writes of a batch that will never be replayed — restored from an
older backup, or a host crash without confirmed fsync — which is a clear stop
(:class:`RedisBehindError`), never a wrong answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from onceflow.dedup.aof import settled_info, where
from onceflow.dedup.errors import RedisBehindError, ServerChangedError, server_changed_message
from onceflow.kernel.errors import ServiceError
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.settings import check_durable
from onceflow.kernel.store import store_for

if TYPE_CHECKING:
    from onceflow.kernel.store import Connection


WAITAOF_VERSION = (7, 2)
DEFAULT_TIMEOUT_MS = 10_000
MARK_FIELD = "durable"  # in every hash tag's clock: the last batch the driver saw durable


@dataclass(frozen=True)
class Durability:
    """What a pipeline waits for before Spark commits a batch or a sink a delivery."""

    waitaof: bool  # ask for the local fsync (the server supports it and fsync is not "always")
    replicas: int  # replicas that must acknowledge (0: none)
    timeout_ms: int = DEFAULT_TIMEOUT_MS
    auto: bool = False  # replicas: one if the master has any when a batch starts, else none
    allow_unconfirmed: bool = False  # --allow-unconfirmed-fsync (see plan_durability)
    allow_non_durable: bool = False  # --allow-non-durable-redis (see replan)
    unconfirmed: bool = False  # a master can confirm neither: allowed (UNCONFIRMED_WARNING)

    def for_batch(self, targets: Sequence[tuple[str, Any]]) -> BatchDurability:
        """What a starting batch waits for, per hash tag, and the server of each tag now.

        ``targets`` pairs each hash tag the batch writes (the namespace's first, then its
        partition scopes) with its client. One ``INFO`` per client gives its master's run id
        and replicas; in the automatic setting each master is waited on for one replica if it
        has one now (after a failover the promoted master has none until the old node returns).
        A server that has not rewritten its AOF since it started is settled first
        (:func:`settle_aof`), so the batch's scripts only ever write on settled servers.
        """
        infos: dict[int, Any] = {}
        replicas: dict[str, int] = {}
        servers: dict[str, str] = {}
        for tag, client in targets:
            if id(client) not in infos:
                infos[id(client)] = settled_info(client)
            info = infos[id(client)]
            wanted = self.replicas
            if self.auto:
                wanted = 1 if int(info.get("connected_slaves", 0)) > 0 else 0
            replicas[tag] = wanted
            servers[tag] = str(info.get("run_id", ""))
        return BatchDurability(replicas, servers, self.waitaof, self.unconfirmed)

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
    """One batch's replicas to wait for, and the server (run id) of each hash tag's master."""

    replicas: Mapping[str, int]  # hash tag -> replicas its master's writes must reach
    servers: Mapping[str, str]  # hash tag -> its master's run id when the batch started
    waitaof: bool = False  # whether a write is durable only once WAITAOF said so
    unconfirmed: bool = False  # whether a master's fsync cannot be confirmed (allowed)

    def replicas_of(self, tag: str) -> int:
        """Replicas to wait for on the master of ``tag``."""
        return self.replicas.get(tag, 0)


@dataclass(frozen=True)
class ServerFacts:
    """What one master says of its persistence."""

    version: tuple[int, ...]
    aof: bool
    fsync: str  # always, everysec, no, or "unknown" (CONFIG forbidden)
    replicas: int  # connected now


def server_facts(client: Connection) -> ServerFacts:
    """Version, AOF and fsync setting, and connected replicas of one master."""
    info = store_for(client).info("server", "persistence", "replication")
    raw = str(info.get("redis_version", "0"))
    version = tuple(int(p) for p in raw.split(".")[:2] if p.isdigit())
    try:
        fsync = str(store_for(client).config_get("appendfsync") or "unknown")
    except Exception:  # noqa: BLE001 - managed Redis often forbids CONFIG
        fsync = "unknown"
    return ServerFacts(
        version, bool(info.get("aof_enabled")), fsync, int(info.get("connected_slaves", 0))
    )


def plan_durability(
    clients: Sequence[Any],
    replicas: int | None,
    timeout_ms: int,
    allow_unconfirmed: bool = False,
    allow_non_durable: bool = False,
) -> Durability:
    """What to wait for: the local fsync where a master can confirm it, and replicas.

    ``clients`` reach every master the pipeline writes to. ``replicas`` None means: one, on
    each master that has a replica connected when a batch starts. A master that can confirm
    neither fsync nor replicas is refused (:func:`unconfirmed_message`) unless
    ``allow_unconfirmed``. ``allow_non_durable`` is kept for :func:`replan`.
    """
    facts = [server_facts(c) for c in clients]
    waitaof = any(_needs_waitaof(f) for f in facts)
    unconfirmed = False
    for client, f in zip(clients, facts, strict=True):
        covered = (replicas or 0) > 0 or (replicas is None and f.replicas > 0)
        if not covered and _unconfirmable(f):
            if not allow_unconfirmed:
                raise ServiceError(unconfirmed_message(client, f))
            unconfirmed = True
    allowed = {"allow_unconfirmed": allow_unconfirmed, "allow_non_durable": allow_non_durable}
    if replicas is None:
        return Durability(waitaof, 0, timeout_ms, auto=True, unconfirmed=unconfirmed, **allowed)
    return Durability(waitaof, replicas, timeout_ms, unconfirmed=unconfirmed, **allowed)


def replan(durability: Durability, clients: Sequence[Any]) -> Durability:
    """The run's start-up checks again, on ``clients`` (every master now; one of them changed).

    A master that failed over or restarted is another server, maybe with other settings: a
    promoted replica with the AOF off, ``appendfsync no``, an evicting policy (refused as at
    start, :func:`onceflow.kernel.settings.check_durable`), or one that now needs ``WAITAOF``
    (:func:`plan_durability`). Raises :class:`ServiceError` with what was found.
    """
    for client in clients:
        check_durable(client, durability.allow_non_durable)
    return plan_durability(
        clients,
        None if durability.auto else durability.replicas,
        durability.timeout_ms,
        durability.allow_unconfirmed,
        durability.allow_non_durable,
    )


def _needs_waitaof(f: ServerFacts) -> bool:
    """Whether a master's AOF is on without ``appendfsync always`` and it can confirm fsyncs."""
    return f.aof and f.fsync != "always" and f.version >= WAITAOF_VERSION


def _unconfirmable(f: ServerFacts) -> bool:
    """An AOF that fsyncs later than it replies, on a Redis that cannot say when it did."""
    return f.aof and f.fsync != "always" and f.version < WAITAOF_VERSION


def unconfirmed_message(client: Connection, f: ServerFacts) -> str:
    """Why a Redis whose fsync cannot be confirmed is refused, and what to do."""
    version = ".".join(str(p) for p in f.version)
    return (
        f"Redis {version} at {where(client)} runs appendfsync {f.fsync} and cannot confirm that a "
        "micro-batch's writes reached its disk (WAITAOF needs Redis 7.2 or later): a crash "
        "of its host could lose up to a second of acknowledged writes that Spark or Kafka "
        "already committed on, which no rerun can redo. Set appendfsync always (CONFIG SET "
        "appendfsync always), use Redis 7.2 or later, or wait for a replica "
        "(--redis-wait-replicas 1); or accept that risk with --allow-unconfirmed-fsync"
    )


UNCONFIRMED_WARNING = (
    "--allow-unconfirmed-fsync: Redis cannot confirm that writes reached its disk. A crash "
    "of its host loses up to a second of acknowledged writes: the micro-batch in flight is "
    "run again from what Redis kept; a delivery to a transactional sink (Kafka, PostgreSQL, "
    "Iceberg, files) whose record Redis lost is found in the sink and counted delivered if "
    "the records run again are those byte for byte, else the run stops and says so (a copy "
    "is never written); a plain sink's may be written again; and writes of a micro-batch "
    "Spark had already committed stop the next start (Redis lost writes). Use appendfsync "
    "always, Redis 7.2+, or a replica to lose nothing"
)


def server_id(client: Connection) -> str:
    """The run id of the server ``client`` talks to: new at every start, and per process."""
    return str(store_for(client).info("server").get("run_id", ""))


def wait_durable(
    targets: Sequence[tuple[Keyspace, Any]],
    batch: int,
    durability: Durability,
    this_batch: BatchDurability,
) -> None:
    """Mark ``batch`` durable on every hash tag once Redis says it is; raise if it is not.

    ``targets`` pairs every hash tag of the pipeline with its client. Tags on the same server
    (same run id when the batch started) share one round trip: their markers, then the waits
    (Redis replicates and fsyncs in order, so the waits cover every write before them), then
    ``INFO`` to check the server is still the one the batch started on.
    """
    groups: dict[str, list[tuple[Keyspace, Any]]] = {}
    for ks, client in targets:
        server = this_batch.servers.get(ks.tag) or f"client-{id(client)}"
        groups.setdefault(server, []).append((ks, client))
    for server, group in groups.items():
        replicas = max(this_batch.replicas_of(k.tag) for k, _ in group)
        _wait_one(group, server, batch, durability, replicas)


def _wait_one(
    group: list[tuple[Keyspace, Any]],
    server: str,
    batch: int,
    durability: Durability,
    replicas: int,
) -> None:
    client = group[0][1]
    cmds = store_for(client).batch()  # one connection: the markers and the waits
    for ks, _ in group:
        cmds.hset(ks.clock, MARK_FIELD, str(batch))
    if durability.waitaof:
        cmds.waitaof(durability.timeout_ms)
    if replicas:
        cmds.wait(replicas, durability.timeout_ms)
    cmds.info("server")
    replies = cmds.execute()
    if str(replies[-1].get("run_id", "")) != server:
        tags = ", ".join(ks.tag for ks, _ in group)
        raise ServerChangedError(server_changed_message(f"hash tag(s) {tags}", batch))
    at = len(group)
    if durability.waitaof:
        check_waitaof(replies[at], f"micro-batch {batch}'s writes", durability.timeout_ms)
        at += 1
    if replicas:
        check_wait(replies[at], replicas, f"micro-batch {batch}'s writes", durability.timeout_ms)


def check_waitaof(reply: Any, what: str, timeout_ms: int) -> None:
    """Raise unless ``WAITAOF 1 0``'s reply says the local AOF holds ``what``."""
    local = reply[0] if isinstance(reply, list | tuple) else reply
    if int(local) < 1:
        msg = (
            f"Redis did not confirm the fsync of {what} within {timeout_ms} ms; it was not "
            "committed (it is run again)"
        )
        raise ServiceError(msg)


def check_wait(reply: Any, replicas: int, what: str, timeout_ms: int) -> None:
    """Raise unless ``WAIT``'s reply says ``replicas`` replicas hold ``what``."""
    acked = int(reply)
    if acked < replicas:
        msg = (
            f"only {acked} of {replicas} Redis replica(s) acknowledged {what} within "
            f"{timeout_ms} ms; it was not committed (it is run again). Check the replicas, "
            "or lower the number required (--redis-wait-replicas)"
        )
        raise ServiceError(msg)


def markers(targets: Sequence[tuple[Keyspace, Any]]) -> dict[str, int | None]:
    """Each hash tag's durable marker: the last batch confirmed there (None: none yet)."""
    out: dict[str, int | None] = {}
    for ks, client in targets:
        raw = store_for(client).hget(ks.clock, MARK_FIELD)
        out[ks.tag] = int(raw) if raw is not None else None
    return out


def check_markers(
    targets: Sequence[tuple[Keyspace, Any]],
    committed: int | None,
    namespace: str,
    marked: bool = False,
) -> None:
    """Refuse a Redis whose markers are behind ``committed``, the last batch Spark committed.

    Every batch's end marks every hash tag of the pipeline, and a tag new to a namespace gets
    the namespace's marker when it is added (:func:`inherit_markers`); so once any tag has a
    marker (or ``marked``: this driver made a batch durable), a tag without one lost its keys:
    a Redis Cluster master that came back empty (a replaced node, an old backup, a promoted
    replica without persistence that restarted). Only a namespace no batch has marked yet
    (its first exactly-once batch) has none. See the module docstring.
    """
    if committed is None:
        return
    found = markers(targets)
    if marked or any(m is not None for m in found.values()):
        empty = [tag for tag, m in found.items() if m is None]
        if empty:
            raise RedisBehindError(_emptied_message(namespace, empty, committed))
    behind = {tag: m for tag, m in found.items() if m is not None and m < committed}
    if not behind:
        return
    tag, marker = min(behind.items(), key=lambda item: item[1])
    msg = (
        f"Redis lost writes of namespace {namespace!r}: hash tag {tag} was last confirmed "
        f"durable at micro-batch {marker}, but Spark committed micro-batch {committed} (its "
        "checkpoint will never replay it). Redis went back in time: restored from an older "
        "backup, or its host crashed with writes it had not fsynced. The results of "
        f"micro-batches {marker + 1} to {committed} cannot be made exact from here: put back "
        "the Redis data that goes with the checkpoint, or start the pipeline over (onceflow "
        "reset)"
    )
    raise RedisBehindError(msg)


def _emptied_message(namespace: str, tags: Sequence[str], committed: int) -> str:
    """Why a hash tag without a durable marker stops a namespace that had them, what to do."""
    more = f" (and {len(tags) - 1} more)" if len(tags) > 1 else ""
    return (
        f"Redis lost writes of namespace {namespace!r}: hash tag {tags[0]}{more} has no "
        "durable marker, where every tag of the namespace had one since its first "
        f"micro-batch, and Spark committed micro-batch {committed}: its keys are gone (a Redis "
        "Cluster master replaced by an empty node or restored from an old backup, or a "
        "replica without persistence promoted and restarted). Its keyed state, timers and "
        "dedup history cannot be made exact from here: put back the Redis data that goes "
        "with the checkpoint, or start the pipeline over (onceflow reset)"
    )


def inherit_markers(home: tuple[Keyspace, Any], added: Sequence[tuple[Keyspace, Any]]) -> None:
    """Give hash tags new to a namespace (a plan change's new stage) the namespace's marker.

    Called before the namespace lists them: from then on a tag without a marker is one that
    lost its keys (:func:`check_markers`). A new tag has nothing to lose yet, so it is as
    durable as the namespace's own.
    """
    ks, client = home
    raw = store_for(client).hget(ks.clock, MARK_FIELD)
    if raw is None:
        return
    for tag, tag_client in added:
        store_for(tag_client).hsetnx(tag.clock, MARK_FIELD, raw)
