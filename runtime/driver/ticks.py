"""Micro-batches without records, for windows whose panes are due (the driver's side).

Windows fire at the end of a micro-batch, by the batch's watermark. The watermark a batch
uses is computed when it starts, from what earlier batches committed; so after the last
records of a burst the watermark has moved (in Redis) but no batch runs to fire the windows
it passed, and an early pane due after some seconds has no batch to fire in either. Spark
runs "no-data" batches for its own stateful operators in that situation; this is the same
for ours: after each batch the driver looks at the next watermark and at the earliest timer
of every windowed combine partition, and when one is due it raises a counter in a file that
the Kafka source's reader (on the driver's machine) turns into a new offset (its *tick*),
so Spark runs one more micro-batch, with no records, in which the panes fire.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from onceflow.dedup.batch import lanes_of, redis_time_ms
from onceflow.dedup.state import EVENT, PROCESSING
from onceflow.kernel.eventtime import EventTime, watermark
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.scopes import Connect, Scopes
from onceflow.kernel.store import Batch, store_for

if TYPE_CHECKING:
    from onceflow.kernel.store import Connection
    from onceflow.runtime.spec import Job


class Ticker:
    """Decides after each micro-batch whether windows need one more (see the module doc)."""

    def __init__(
        self,
        client: Connection,
        ks: Keyspace,
        scopes: Scopes,
        connect: Connect,
        job: Job,
        parallelism: int,
        path: str,
        processing_time: bool,
    ) -> None:
        self.client = client
        self.ks = ks
        self.scopes = scopes
        self.connect = connect
        self.event_time = job.event_time or EventTime()
        self.nodes = [
            (spec.name, op.name)
            for spec, op in job.stateful_ops()
            # they have timers: windows, process ops, combines whose expiry is a delete
            if op.windowing is not None or op.process is not None or op.expiry_deletes
        ]
        self.parallelism = parallelism
        self.path = path
        self.processing_time = processing_time  # False: available-now runs end on their own
        self.asked = 0
        self.ticks = 0
        if self.nodes:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._write(0)

    @property
    def needed(self) -> bool:
        """Whether the job has windows at all."""
        return bool(self.nodes)

    def after_batch(self, lead_ms: int) -> bool:
        """Ask for a tick when a timer is due by the next batch; True when asked.

        ``lead_ms``: how long until the next batch starts (its trigger interval).
        """
        if not self.nodes:
            return False
        now = redis_time_ms(self.client)
        clock = store_for(self.client).hget(self.ks.clock, "watermark")
        previous = int(clock) if clock is not None else 0
        next_wm = watermark(lanes_of(self.client, self.ks), now, previous, self.event_time)
        event, processing = self._earliest()
        due = (event is not None and event <= next_wm) or (
            self.processing_time and processing is not None and processing <= now + lead_ms
        )
        if due:
            self.asked += 1
            self.ticks += 1
            self._write(self.asked)
        return due

    def _earliest(self) -> tuple[float | None, float | None]:
        batches: dict[int, Batch] = {}  # one round trip per client (per master on a cluster)
        for stage, node in self.nodes:
            for p in range(self.parallelism):
                ks = self.scopes.keyspace(stage, p)
                store = store_for(self.connect(ks.tag))
                cmds = batches.get(id(store))
                if cmds is None:
                    cmds = batches[id(store)] = store.batch()
                cmds.zrange_first(ks.timers(EVENT, node, p))
                cmds.zrange_first(ks.timers(PROCESSING, node, p))
        replies = [r for cmds in batches.values() for r in cmds.execute()]
        event = [r[0][1] for r in replies[0::2] if r]
        processing = [r[0][1] for r in replies[1::2] if r]
        return min(event, default=None), min(processing, default=None)

    def _write(self, n: int) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as fh:
            fh.write(str(n))
        os.replace(tmp, self.path)
