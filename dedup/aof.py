"""Settling a server's AOF: no torn transaction of a host crash comes back at a later start.

A host crash can cut the AOF in the middle of a command. Redis (``aof-load-truncated yes``,
its default) then loads the file up to the last whole command and truncates it there; when
that command lies inside a ``MULTI`` block (how Redis writes a script's effects to the AOF)
the block stays open at the file's end: the data in memory is right, the file is not. The
next transaction written after it completes the open block, so the *next* start of the
server applies the torn half of a script (seen-marks without the backup they were committed
with, say): a loss no replay repairs. So before anything writes a script on a server that has
not rewritten its AOF since it started, :func:`settle_aof` has Redis rewrite it
(``BGREWRITEAOF``: the files are made again from memory, the torn block is gone) and waits for
it. A rewrite that fails (a folder the server cannot write, a full disk) stops the run: the
torn file would stay. Redis 6 counts no rewrites in ``INFO``; its
``aof_last_rewrite_time_sec`` (-1 until one ran) says the same.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from onceflow.kernel.errors import ServiceError
from onceflow.kernel.store import store_for

if TYPE_CHECKING:
    from onceflow.kernel.store import Connection

log = logging.getLogger(__name__)

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
    """An AOF this server has not rewritten since it started (it may end in a torn block).

    Rewritten means: a rewrite ran since the start (``aof_rewrites``; Redis before 7 does not
    count them, its ``aof_last_rewrite_time_sec`` is -1 until one ran) and the last one
    succeeded (``aof_last_bgrewrite_status``): a failed rewrite leaves the old file in place.
    """
    if not info.get("aof_enabled"):
        return False
    rewrites = info.get("aof_rewrites")
    if rewrites is None:
        ran = int(info.get("aof_last_rewrite_time_sec", -1)) >= 0
    else:
        ran = int(rewrites) > 0
    return not ran or str(info.get("aof_last_bgrewrite_status", "ok")) != "ok"


# What Redis says to a BGREWRITEAOF it cannot run now but will (one is already running).
_REWRITE_BUSY = ("progress", "scheduled", "already")
# What it says when the command is not allowed here (renamed away, an ACL, a managed service).
_REWRITE_FORBIDDEN = ("unknown command", "noperm", "no permission", "not allowed", "disabled")


def settle_aof(client: Connection, timeout_s: float = SETTLE_TIMEOUT_S) -> str:
    """Have a server rewrite its AOF unless it did since it started; return its run id.

    See the module docstring (a torn transaction in the AOF). Idempotent, and cheap after
    the first call per server start. A Redis that forbids ``BGREWRITEAOF`` (some managed
    services) is used as it is, with one warning: its files are the provider's to keep. A
    rewrite that fails (a folder the server cannot write, a full disk) is a
    :class:`ServiceError`: the torn file would stay.
    """
    info = store_for(client).info("server", "persistence")
    run_id = str(info.get("run_id", ""))
    if run_id in _SETTLED or not _needs_rewrite(info):
        _SETTLED.add(run_id)
        return run_id
    try:
        store_for(client).rewrite_aof()
    except Exception as exc:  # noqa: BLE001 - one in progress, scheduled, forbidden or failed
        text = str(exc).lower()
        if any(word in text for word in _REWRITE_FORBIDDEN):
            log.warning(
                "Redis at %s refused BGREWRITEAOF (%s): a torn transaction its AOF may end "
                "in after a host crash cannot be removed from here",
                where(client),
                exc,
            )
            _SETTLED.add(run_id)
            return run_id
        if not any(word in text for word in _REWRITE_BUSY):
            raise ServiceError(_rewrite_failed(client, str(exc))) from exc
    return _await_rewrite(client, run_id, time.monotonic() + timeout_s, timeout_s)


def _await_rewrite(client: Connection, run_id: str, deadline: float, timeout_s: float) -> str:
    """Wait until the rewrite of ``run_id``'s AOF succeeded; raise if it failed or took long."""
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
            status = f"aof_last_bgrewrite_status {now.get('aof_last_bgrewrite_status')}"
            raise ServiceError(_rewrite_failed(client, status))
        if time.monotonic() > deadline:
            msg = (
                f"Redis at {where(client)} did not finish rewriting its AOF within "
                f"{timeout_s:.0f} s after a restart; see its log"
            )
            raise ServiceError(msg)
        if time.monotonic() - said > 10:
            log.warning("waiting for Redis at %s to rewrite its AOF", where(client))
            said = time.monotonic()
        time.sleep(0.02)


def _rewrite_failed(client: Connection, found: str) -> str:
    """Why a server whose AOF rewrite failed is not written to, and what to do."""
    return (
        f"Redis at {where(client)} could not rewrite its AOF after a restart ({found}): "
        "until it does, a transaction a host crash tore at the file's end would come back "
        "half applied at its next start, so nothing is written to it. See its log (a folder "
        "it cannot write? a full disk?), fix that, and start the run again"
    )


def where(client: Connection) -> str:
    """``host:port`` of the server ``client`` talks to, for messages."""
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
    host, port = kwargs.get("host"), kwargs.get("port")
    return f"{host}:{port}" if host else "the configured address"
