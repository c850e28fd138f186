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

**A torn transaction in the AOF.** A host crash can cut the AOF in the middle of a command.
Redis (``aof-load-truncated yes``, its default) then loads the file up to the last whole
command and truncates it there; when that command lies inside a ``MULTI`` block (how Redis
writes a script's effects to the AOF) the block stays open at the file's end: the data in
memory is right, the file is not. The next transaction written after it completes the open
block, so the *next* start of the server applies the torn half of a script — seen-marks
without the backup they were committed with, say: a loss no replay repairs. So before
anything writes a script on a server that has not rewritten its AOF since it started,
:func:`settle_aof` has Redis rewrite it (``BGREWRITEAOF``: the files are made again from
memory, the torn block is gone) and waits for it; every batch starts on settled servers
(:meth:`Durability.for_batch`), and the driver's own multi-write script between batches
checks the server as tasks' scripts do.

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

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from onceflow.dedup.errors import RedisBehindError, ServerChangedError, server_changed_message
from onceflow.kernel.errors import ServiceError
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.store import store_for

if TYPE_CHECKING:
    from onceflow.kernel.store import Connection

log = logging.getLogger(__name__)

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
        return BatchDurability(replicas, servers, self.waitaof)

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
) -> Durability:
    """What to wait for: the local fsync where a master can confirm it, and replicas.

    ``clients`` reach every master the pipeline writes to. ``replicas`` None means: one, on
    each master that has a replica connected when a batch starts. A master that can confirm
    neither fsync nor replicas is refused (:func:`unconfirmed_message`) unless
    ``allow_unconfirmed``.
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
    if replicas is None:
        return Durability(waitaof, 0, timeout_ms, auto=True, unconfirmed=unconfirmed)
    return Durability(waitaof, replicas, timeout_ms, unconfirmed=unconfirmed)


def _needs_waitaof(f: ServerFacts) -> bool:
    """Whether a master's AOF is on without ``appendfsync always`` and it can confirm fsyncs."""
    return f.aof and f.fsync != "always" and f.version >= WAITAOF_VERSION


def _unconfirmable(f: ServerFacts) -> bool:
    """An AOF that fsyncs later than it replies, on a Redis that cannot say when it did."""
    return f.aof and f.fsync != "always" and f.version < WAITAOF_VERSION


def unconfirmed_message(client: Connection, f: ServerFacts) -> str:
    """Why a Redis whose fsync cannot be confirmed is refused, and what to do."""
    where = _where(client)
    version = ".".join(str(p) for p in f.version)
    return (
        f"Redis {version} at {where} runs appendfsync {f.fsync} and cannot confirm that a "
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


def _where(client: Connection) -> str:
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
    host, port = kwargs.get("host"), kwargs.get("port")
    return f"{host}:{port}" if host else "the configured address"


_SETTLED: set[str] = set()  # run ids whose AOF this process saw rewritten since they started
SETTLE_TIMEOUT_S = 600.0


def settled_info(client: Connection) -> Any:
    """``INFO server replication persistence`` of a settled server (see :func:`settle_aof`)."""
    while True:
        info = store_for(client).info("server", "replication", "persistence")
        run_id = str(info.get("run_id", ""))
        if run_id in _SETTLED or not _needs_rewrite(info):
            _SETTLED.add(run_id)
            return info
        settle_aof(client)


def _needs_rewrite(info: Mapping[str, Any]) -> bool:
    """An AOF this server has not rewritten since it started (it may end in a torn block)."""
    if not info.get("aof_enabled"):
        return False
    rewrites = info.get("aof_rewrites")
    return rewrites is None or int(rewrites) == 0


def settle_aof(client: Connection, timeout_s: float = SETTLE_TIMEOUT_S) -> str:
    """Have a server rewrite its AOF unless it did since it started; return its run id.

    See the module docstring (a torn transaction in the AOF). Idempotent, and cheap after
    the first call per server start. A Redis that forbids ``BGREWRITEAOF`` (some managed
    services) is used as it is, with one warning: its files are the provider's to keep.
    """
    info = store_for(client).info("server", "persistence")
    run_id = str(info.get("run_id", ""))
    if run_id in _SETTLED or not _needs_rewrite(info):
        _SETTLED.add(run_id)
        return run_id
    try:
        store_for(client).rewrite_aof()
    except Exception as exc:  # noqa: BLE001 - one in progress, scheduled, or forbidden
        text = str(exc).lower()
        if "progress" not in text and "scheduled" not in text and "already" not in text:
            log.warning(
                "Redis at %s refused BGREWRITEAOF (%s): a torn transaction its AOF may end "
                "in after a host crash cannot be removed from here",
                _where(client),
                exc,
            )
            _SETTLED.add(run_id)
            return run_id
    deadline = time.monotonic() + timeout_s
    said = time.monotonic()
    while True:
        now = store_for(client).info("server", "persistence")
        if str(now.get("run_id", "")) != run_id:
            return settle_aof(client, max(1.0, deadline - time.monotonic()))  # it restarted
        busy = int(now.get("aof_rewrite_in_progress", 0)) or int(
            now.get("aof_rewrite_scheduled", 0)
        )
        if not busy and not _needs_rewrite(now):
            _SETTLED.add(run_id)
            return run_id
        if not busy and str(now.get("aof_last_bgrewrite_status", "ok")) != "ok":
            msg = (
                f"Redis at {_where(client)} failed to rewrite its AOF after a restart "
                f"(aof_last_bgrewrite_status {now.get('aof_last_bgrewrite_status')}); see "
                "its log (disk full?)"
            )
            raise ServiceError(msg)
        if time.monotonic() > deadline:
            msg = (
                f"Redis at {_where(client)} did not finish rewriting its AOF within "
                f"{timeout_s:.0f} s after a restart; see its log"
            )
            raise ServiceError(msg)
        if time.monotonic() - said > 10:
            log.warning("waiting for Redis at %s to rewrite its AOF", _where(client))
            said = time.monotonic()
        time.sleep(0.02)


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
    targets: Sequence[tuple[Keyspace, Any]], committed: int | None, namespace: str
) -> None:
    """Refuse a Redis whose markers are behind ``committed``, the last batch Spark committed.

    A tag without a marker (a namespace made before markers, or a scope its first batch has
    not reached) says nothing. See the module docstring.
    """
    if committed is None:
        return
    behind = {tag: m for tag, m in markers(targets).items() if m is not None and m < committed}
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
