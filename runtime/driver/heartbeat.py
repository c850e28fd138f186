"""A running driver says so in Redis, so that nobody resets its namespace under it.

While a streaming run is alive its driver keeps the namespace's ``driver`` key
(:attr:`~onceflow.kernel.keyspace.Keyspace.driver`) set to who it is (host, process,
epoch, start), with a time-to-live of :data:`TTL_MS` refreshed every :data:`EVERY_S`
seconds by a thread of its own. A driver that ends deletes it; one that dies (kill -9, a
lost machine) leaves it to expire. ``onceflow reset`` refuses while the key exists, and
``onceflow status`` shows it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.script_args import delete_if_equal
from onceflow.kernel.store import store_for

if TYPE_CHECKING:
    from onceflow.kernel.store import Connection

TTL_MS = 30_000
EVERY_S = 5.0

log = logging.getLogger(__name__)


def driver_info(epoch: int, pipeline: str) -> dict[str, Any]:
    """Who this driver is, as the key holds it."""
    return {
        "pipeline": pipeline,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "epoch": epoch,
        "started_ms": int(time.time() * 1000),
    }


def running_driver(client: Connection, ks: Keyspace) -> dict[str, Any] | None:
    """The driver that says it runs the namespace, or None."""
    raw = store_for(client).get(ks.driver)
    if raw is None:
        return None
    try:
        found = json.loads(raw)
    except ValueError:
        return {"raw": raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)}
    return found if isinstance(found, dict) else {"raw": str(found)}


class DriverHeartbeat:
    """Keeps :attr:`Keyspace.driver` set while the run lives (see the module docstring)."""

    def __init__(self, client: Connection, ks: Keyspace, info: dict[str, Any]) -> None:
        self.client = client
        self.ks = ks
        self.value = json.dumps(info, sort_keys=True)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="onceflow-heartbeat", daemon=True)

    def start(self) -> DriverHeartbeat:
        """Set the key now, then keep it set."""
        store_for(self.client).set(self.ks.driver, self.value, px=TTL_MS)
        self.thread.start()
        return self

    def _beat(self) -> None:
        while not self.stopped.wait(EVERY_S):
            try:
                store_for(self.client).set(self.ks.driver, self.value, px=TTL_MS)
            except Exception as exc:  # noqa: BLE001 - Redis away for a moment: next beat
                log.debug("driver heartbeat not written: %s", exc)

    def stop(self) -> None:
        """Stop beating and delete the key if it is still this driver's."""
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(EVERY_S)
        with contextlib.suppress(Exception):  # it expires by itself anyway
            keys, args = delete_if_equal(self.ks.driver, self.value)
            store_for(self.client).script("delete_if_equal", keys, args)
