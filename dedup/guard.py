"""The exactly-once guard: the task hooks of :mod:`onceflow.runtime.guard`, backed by Redis.

For one stage, micro-batch and partition it composes the receiving side's steps:

* ``open``: bump the task's fencing token, read the task's backup (replayed, never
  recomputed) and make every receiver's Bloom filters trustworthy (:mod:`~.trust`);
* ``admit``: Bloom first, Redis only for "maybe"s; late records are returned as such
  (:mod:`~.admission`);
* ``commit``: one atomic Lua call marks the IDs seen and stores outputs and state
  (:mod:`~.commit`);
* sinks: ``undelivered`` skips what an earlier attempt delivered, ``delivered`` marks what the
  sink acknowledged (:mod:`~.delivery`);
* ``close``: snapshot filters whose journal grew long.

Receivers are the stage itself (its inputs) and each sink it writes (``<sink>/delivered``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from onceflow.backup import store as backup
from onceflow.backup.format import TaskBackup
from onceflow.dedup import trust
from onceflow.dedup.addressing import Addressing
from onceflow.dedup.admission import Admission, admit
from onceflow.dedup.commit import commit_chunk
from onceflow.dedup.config import DedupConfig
from onceflow.dedup.delivery import mark_delivered, receiver_name, undelivered
from onceflow.dedup.errors import HorizonMovedError
from onceflow.dedup.session import TaskSession
from onceflow.dedup.state import read_state
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.records import Guarantee, InRow, Output, TaskRef
from onceflow.kernel.scripts import scripts_for
from onceflow.kernel.settings import RedisSettings, redis_client

# Counted in Redis only (status shows them); the task counts its own for the run's summary.
_REDIS_ONLY = frozenset({"in", "duplicates", "late", "committed", "out", "horizon_redone"})


@dataclass(frozen=True)
class ExactlyOnceGuards:
    """Guard factory for one driver epoch (pickled to the workers)."""

    redis: RedisSettings
    namespace: str
    epoch: int
    config: DedupConfig

    def __call__(self, task: TaskRef) -> ExactlyOnceGuard:
        """A guard for one task."""
        return ExactlyOnceGuard(self, task)


class ExactlyOnceGuard:
    """Exactly-once hooks of one task (see the module docstring)."""

    mode = Guarantee.EXACTLY_ONCE

    def __init__(self, factory: ExactlyOnceGuards, task: TaskRef) -> None:
        client = redis_client(factory.redis)
        ks = Keyspace(factory.namespace)
        self.config = factory.config
        self.chunk_size = factory.config.chunk_size
        self.session = TaskSession(
            client,
            scripts_for(client),
            ks,
            factory.config,
            str(factory.epoch),
            task.stage,
            task.batch,
            task.partition,
        )
        self.addressing = Addressing(ks, factory.config)
        self.stage = trust.Receiver(factory.namespace, task.stage, task.partition, self.config)
        self.sinks = {
            index: trust.Receiver(
                factory.namespace, receiver_name(name), task.partition, self.config
            )
            for index, name in task.sinks
        }
        self.admitted: set[bytes] = set()
        self._admitted_counts: dict[str, int] = {}

    @property
    def receivers(self) -> list[trust.Receiver]:
        """The stage's own receiver and its sinks'."""
        return [self.stage, *self.sinks.values()]

    def open(self) -> TaskBackup:
        """Fence older attempts, read the backup, make the filters trustworthy."""
        s = self.session
        ks = s.ks
        pipe = s.client.pipeline(transaction=False)
        pipe.incr(ks.token(s.stage, s.partition))
        pipe.get(ks.acked_watermark)
        pipe.hgetall(ks.backup(s.stage, s.batch, s.partition))
        for r in self.receivers:
            pipe.get(ks.filter_seq(r.name, s.partition))
            pipe.hget(ks.filter_snapshot(r.name, s.partition), trust.SEQ_FIELD)
        replies = pipe.execute()
        s.round_trip()
        s.token = str(replies[0])
        s.floor = self.config.floor(int(replies[1] or 0))
        for n, r in enumerate(self.receivers):
            r.redis_seq = int(replies[3 + 2 * n] or 0)
            r.snapshot_seq = int(replies[4 + 2 * n] or 0)
        trust.catch_up(s, self.receivers)
        return backup.replay(replies[2])

    def admit(self, rows: list[InRow]) -> Admission:
        """Which rows of a chunk are new (see :mod:`onceflow.dedup.admission`)."""
        adm, self._admitted_counts = admit(
            self.session, self.stage, self.addressing, self.admitted, rows
        )
        return adm

    def read_state(self, node: str, keys: Sequence[bytes]) -> Mapping[bytes, bytes | None]:
        """Current accumulators of ``keys`` for a stateful combine of this partition."""
        if not keys:
            return {}
        s = self.session
        s.round_trip()
        return read_state(s.client, s.ks, node, s.partition, keys)

    def commit(
        self,
        chunk: int,
        fresh: list[InRow],
        outputs: list[Output],
        updates: Mapping[str, Mapping[bytes, bytes]],
    ) -> set[bytes]:
        """Atomically mark ``fresh`` seen and store outputs and state; see :mod:`~.commit`."""
        if not fresh and not outputs and not any(updates.values()):
            return set()
        s = self.session
        try:
            seq, conflicts = commit_chunk(s, self.addressing, chunk, fresh, outputs, updates)
        except HorizonMovedError:  # the chunk is admitted again: its counts go with it
            s.uncount(self._admitted_counts)
            s.count("horizon_redone")
            raise
        if conflicts:
            return conflicts
        if seq > 0:
            self.stage.filters.seq = seq
        self.admitted.update(row[1] for row in fresh)
        return set()

    def finish(self, outputs: list[Output]) -> None:
        """Store the end-of-task outputs and mark the task done, in one step."""
        s = self.session
        s.count("out", sum(1 for o in outputs if o.target >= 0))
        epoch_key, token_key = s.fence_keys()
        reply = backup.finish(
            s.client,
            (epoch_key, token_key, s.epoch, s.token),
            s.ks.backup(s.stage, s.batch, s.partition),
            s.ks.stats(s.stage),
            outputs,
            s.stat_args(),
        )
        s.check(reply)
        s.round_trip()
        s.pending.clear()

    def undelivered(self, target: int, outputs: list[Output]) -> list[Output]:
        """Sink records no attempt has delivered yet."""
        return undelivered(self.session, self.sinks[target], self.addressing, outputs)

    def delivered(self, target: int, outputs: list[Output]) -> None:
        """Mark sink records delivered (after the sink acknowledged them)."""
        mark_delivered(self.session, self.sinks[target], self.addressing, outputs)

    def close(self) -> dict[str, Any]:
        """Snapshot filters whose journal grew long; return counters for the run."""
        for r in self.receivers:
            trust.snapshot(self.session, r)
        counters = {k: v for k, v in self.session.counters.items() if k not in _REDIS_ONLY}
        counters["bloom_bytes"] = sum(r.filters.memory_bytes() for r in self.receivers)
        return counters
