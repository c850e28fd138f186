"""Waiting until a micro-batch's writes are durable, before Spark commits the batch.

Every commit of a batch returns once Redis applied it; that is not yet on disk (with
``appendfsync everysec`` the AOF is fsynced once a second) nor on a replica (replication is
asynchronous). If Spark committed the batch and Redis then lost its last writes (a machine
crash, a failover to a replica that lagged), the batch's seen-marks and state would be gone
while Spark would never replay it: silent loss or duplicates. So at the end of every batch
the driver writes a marker and waits, on that same connection, until Redis says every write
before it is durable:

* ``WAITAOF 1 0`` (Redis 7.2 and later): fsynced to the local AOF. With ``appendfsync
  always`` every write already is; on an older Redis with ``everysec`` this cannot be asked,
  and a host crash may roll back up to a second of commits (said once at start);
* ``WAIT n`` when replicas are required: acknowledged by ``n`` replicas.

Redis serializes writes, so a marker written after the batch's tasks finished covers them
all. If the wait times out the batch is not committed (the run stops with the reason, and a
restart replays the batch): a clear stop, never a silent loss.
"""

from __future__ import annotations

from dataclasses import dataclass
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

    def describe(self) -> str:
        """One line for the run's start."""
        parts = []
        if self.waitaof:
            parts.append("the AOF fsync (WAITAOF)")
        if self.replicas:
            parts.append(f"{self.replicas} replica(s) (WAIT)")
        return " and ".join(parts) if parts else "nothing more than Redis's reply"


def _version(client: Any) -> tuple[int, ...]:
    raw = str(client.info("server").get("redis_version", "0"))
    return tuple(int(p) for p in raw.split(".")[:2] if p.isdigit())


def plan_durability(client: Any, replicas: int | None, timeout_ms: int) -> Durability:
    """What to wait for: the local fsync when it can be asked, and replicas.

    ``replicas`` None means: one, if the server has any replica connected now.
    """
    info = client.info("persistence")
    try:
        fsync = str(client.config_get("appendfsync").get("appendfsync"))
    except Exception:  # noqa: BLE001 - managed Redis often forbids CONFIG
        fsync = "unknown"
    waitaof = bool(info.get("aof_enabled")) and fsync != "always"
    waitaof = waitaof and _version(client) >= WAITAOF_VERSION
    if replicas is None:
        connected = int(client.info("replication").get("connected_slaves", 0))
        replicas = 1 if connected > 0 else 0
    return Durability(waitaof, replicas, timeout_ms)


def cannot_fsync_warning(client: Any) -> str | None:
    """A warning when per-batch fsync cannot be confirmed (older Redis with everysec)."""
    try:
        fsync = str(client.config_get("appendfsync").get("appendfsync"))
    except Exception:  # noqa: BLE001
        return None
    if fsync == "everysec" and _version(client) < WAITAOF_VERSION:
        return (
            "Redis before 7.2 cannot confirm that a batch's writes were fsynced (WAITAOF); "
            "with appendfsync everysec a host crash may roll back up to a second of commits. "
            "Use appendfsync always, or Redis 7.2+, for that guarantee"
        )
    return None


def wait_durable(client: Any, ks: Keyspace, batch: int, durability: Durability) -> None:
    """Block until every write so far is durable as ``durability`` asks; raise if it is not."""
    if not durability.waitaof and not durability.replicas:
        return
    pipe = client.pipeline(transaction=False)  # one connection: the marker and the waits
    pipe.hset(ks.batch(batch), MARK_FIELD, "1")
    if durability.waitaof:
        pipe.execute_command("WAITAOF", 1, 0, durability.timeout_ms)
    if durability.replicas:
        pipe.execute_command("WAIT", durability.replicas, durability.timeout_ms)
    replies = pipe.execute()
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
    if durability.replicas:
        acked = int(replies[at])
        if acked < durability.replicas:
            msg = (
                f"only {acked} of {durability.replicas} Redis replica(s) acknowledged "
                f"micro-batch {batch}'s writes within {durability.timeout_ms} ms; the batch is "
                "not committed (a restart replays it). Check the replicas, or lower the "
                "number required (--redis-wait-replicas)"
            )
            raise ServiceError(msg)
