"""The guard contract: what a task asks of the exactly-once machinery, and two cheap guards.

A task's loop (:mod:`onceflow.runtime.task`) is the same for every guarantee; a *guard*
decides what it costs. :class:`NoGuard` makes everything free for bounded runs;
:class:`AtLeastOnceGuard` keeps keyed state in Redis and nothing else (the benchmark's
baseline); the exactly-once guard lives in :mod:`onceflow.dedup.guard`. Guards are built on
the workers by a factory pickled from the driver.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from onceflow.backup.format import TaskBackup
from onceflow.dedup.admission import Admission
from onceflow.dedup.config import DedupConfig
from onceflow.dedup.state import read_state, write_state
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.records import Guarantee, InRow, Output, TaskRef
from onceflow.kernel.settings import RedisSettings, redis_client

# The at-least-once baseline commits state in chunks of at least this many records.
AT_LEAST_ONCE_MIN_CHUNK = 5000


class Guard(Protocol):
    """The per-task hooks that make a stage exactly-once (or not)."""

    mode: Guarantee
    chunk_size: int

    def open(self) -> TaskBackup:
        """Start the task; return what earlier attempts committed (replayed, not recomputed)."""
        ...

    def admit(self, rows: list[InRow]) -> Admission:
        """Split a chunk into fresh rows and rows to skip."""
        ...

    def read_state(self, node: str, keys: Sequence[bytes]) -> Mapping[bytes, bytes | None]:
        """Current keyed state of ``node`` for ``keys``."""
        ...

    def commit(
        self,
        chunk: int,
        fresh: list[InRow],
        outputs: list[Output],
        updates: Mapping[str, Mapping[bytes, bytes]],
    ) -> set[bytes]:
        """Atomically store a chunk's effects; return IDs that conflicted (nothing stored)."""
        ...

    def finish(self, outputs: list[Output]) -> None:
        """Commit end-of-task outputs and mark the task done."""
        ...

    def undelivered(self, target: int, outputs: list[Output]) -> list[Output]:
        """The records for sink output ``target`` not yet delivered by any attempt."""
        ...

    def delivered(self, target: int, outputs: list[Output]) -> None:
        """Mark sink records delivered (after the sink acknowledged them)."""
        ...

    def close(self) -> dict[str, int]:
        """End the task; return counters for the run's metrics."""
        ...


class GuardFactory(Protocol):
    """Builds a guard for one task on the worker (pickled from the driver)."""

    def __call__(self, task: TaskRef) -> Guard:
        """A guard for this task."""
        ...


class NoGuard:
    """Bounded runs: no IDs, no backup, no dedup; a failed task simply runs again."""

    mode = Guarantee.BOUNDED
    chunk_size = 0  # whole Arrow batches

    def open(self) -> TaskBackup:
        """Nothing was committed before."""
        return TaskBackup()

    def admit(self, rows: list[InRow]) -> Admission:
        """Everything is fresh."""
        return Admission(rows)

    def read_state(self, node: str, keys: Sequence[bytes]) -> Mapping[bytes, bytes | None]:
        """Bounded combines keep no state outside the task."""
        return {}

    def commit(
        self,
        chunk: int,
        fresh: list[InRow],
        outputs: list[Output],
        updates: Mapping[str, Mapping[bytes, bytes]],
    ) -> set[bytes]:
        """Nothing to store."""
        return set()

    def finish(self, outputs: list[Output]) -> None:
        """Nothing to store."""

    def undelivered(self, target: int, outputs: list[Output]) -> list[Output]:
        """Everything is new."""
        return outputs

    def delivered(self, target: int, outputs: list[Output]) -> None:
        """Nothing to mark."""

    def close(self) -> dict[str, Any]:
        """No counters of its own."""
        return {}


def no_guard(task: TaskRef) -> Guard:
    """The bounded-run guard factory."""
    return NoGuard()


@dataclass(frozen=True)
class AtLeastOnceGuards:
    """The baseline's factory: keyed state in Redis, no IDs, no backup, no dedup."""

    redis: RedisSettings
    namespace: str
    config: DedupConfig

    def __call__(self, task: TaskRef) -> Guard:
        """A guard for one task."""
        return AtLeastOnceGuard(self, task.partition)


class AtLeastOnceGuard(NoGuard):
    """Keyed state in Redis, read-merge-write per chunk; a crash may apply a chunk twice."""

    mode = Guarantee.AT_LEAST_ONCE

    def __init__(self, factory: AtLeastOnceGuards, partition: int) -> None:
        self.chunk_size = max(factory.config.chunk_size, AT_LEAST_ONCE_MIN_CHUNK)
        self.ks = Keyspace(factory.namespace)
        self.client = redis_client(factory.redis)
        self.partition = partition
        self.round_trips = 0

    def read_state(self, node: str, keys: Sequence[bytes]) -> Mapping[bytes, bytes | None]:
        """Current accumulators."""
        if not keys:
            return {}
        self.round_trips += 1
        return read_state(self.client, self.ks, node, self.partition, keys)

    def commit(
        self,
        chunk: int,
        fresh: list[InRow],
        outputs: list[Output],
        updates: Mapping[str, Mapping[bytes, bytes]],
    ) -> set[bytes]:
        """Write state (not atomically with anything)."""
        if any(updates.values()):
            write_state(self.client, self.ks, self.partition, updates)
            self.round_trips += 1
        return set()

    def close(self) -> dict[str, Any]:
        """Round trips, for the benchmark."""
        return {"redis_round_trips": self.round_trips}
