"""The guard contract: what a task asks of the exactly-once machinery, and two cheap guards.

A task's loop (:mod:`onceflow.runtime.task.loop`) is the same for every guarantee; a *guard*
decides what it costs. :class:`NoGuard` makes everything free for bounded runs;
:class:`AtLeastOnceGuard` keeps keyed state in Redis and nothing else (the benchmark's
baseline); the exactly-once guard lives in :mod:`onceflow.dedup.guard`. Guards are built on
the workers by a factory pickled from the driver.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from onceflow.backup.format import TaskBackup
from onceflow.dedup.admission import Admission
from onceflow.dedup.batch import BatchParams
from onceflow.dedup.config import DedupConfig
from onceflow.dedup.delivery import PendingDelivery, SinkState
from onceflow.dedup.state import due_timers, read_state, write_state
from onceflow.kernel import script_args
from onceflow.kernel.limits import CHUNK_BYTES, DELIVERY_BYTES, DELIVERY_RECORDS, Budget
from onceflow.kernel.records import Guarantee, InRow, Output, StateWrite, TaskRef
from onceflow.kernel.scopes import Scopes
from onceflow.kernel.settings import RedisSettings, redis_client
from onceflow.kernel.store import store_for

# The at-least-once baseline commits state in chunks of at least this many records.
AT_LEAST_ONCE_MIN_CHUNK = 5000


class Guard(Protocol):
    """The per-task hooks that make a stage exactly-once (or not)."""

    mode: Guarantee
    chunk_size: int  # records per chunk (0: whole Arrow batches)
    chunk_bytes: int  # bytes per chunk, of its inputs and again of what it writes
    delivery: Budget  # sink records held and delivered together
    limit_ms: int | None  # the newest event time admitted, if there is a limit
    watermark: int | None  # the micro-batch's watermark (None: bounded, nothing is late)
    previous_watermark: int | None  # the batch before's: windows it closed are closed
    batch_time_ms: int | None  # the micro-batch's time (processing-time triggers, ttl)
    # sinks' delivery marks (see onceflow.runtime.task.sink_delivery): the namespace's incarnation;
    # whether marks carry their records' digest (Redis may lose a delivery a sink committed);
    # whether sinks deliver after the batch's one durable wait (group commit); whether this
    # attempt may run on a Redis that went back (then the sinks' own marks are read)
    incarnation: str
    lossy: bool
    deferred: bool
    recheck: bool

    def open(self) -> TaskBackup:
        """Start the task; return what earlier attempts committed (replayed, not recomputed)."""
        ...

    def open_sinks(self) -> TaskBackup:
        """Start the task only to deliver what earlier attempts backed up for the sinks."""
        ...

    def admit(
        self,
        rows: list[InRow],
        positional: Sequence[bool] = (),
        fingerprints: Sequence[int] = (),
    ) -> Admission:
        """Split a chunk into fresh rows and rows to skip.

        ``positional``: per row, whether its ID is positional (empty: none is); ``fingerprints``:
        per row, its content fingerprint (empty: none known; see
        :class:`~onceflow.kernel.records.Record`).
        """
        ...

    def read_state(self, node: str, keys: Sequence[bytes]) -> Mapping[bytes, bytes | None]:
        """Current keyed state of ``node`` for ``keys``."""
        ...

    def due_timers(self, node: str, watermark: int, now: int) -> Sequence[bytes]:
        """Keys of windowed combine ``node`` with a timer due at ``watermark`` / ``now``."""
        ...

    def commit(
        self,
        chunk: int,
        fresh: list[InRow],
        outputs: list[Output],
        updates: Mapping[str, StateWrite],
        lanes: Mapping[str, int],
        unmarked: Collection[bytes] = frozenset(),
    ) -> set[bytes]:
        """Atomically store a chunk's effects; return IDs that conflicted (nothing stored).

        ``lanes``: the newest event time per source lane the chunk read (the watermark's
        input), committed with it; ``unmarked``: IDs of ``fresh`` that admission said need
        no seen-mark (:attr:`Admission.unmarked`). May raise
        :class:`~onceflow.dedup.commit.FloorRaised` (then :meth:`raise_floor` and admit the
        chunk again).
        """
        ...

    def raise_floor(self, floor_ms: int) -> None:
        """Records older than ``floor_ms`` are late from now on (GC deleted their history)."""
        ...

    def conflicting_content(self) -> set[bytes]:
        """IDs among the last commit's conflicts that another record with other content has."""
        ...

    def is_late(self, ts: int) -> bool:
        """Whether a record of event time ``ts`` is older than the dedup floor."""
        ...

    def finish(self, outputs: list[Output], changes: Mapping[str, StateWrite]) -> None:
        """Commit end-of-task outputs with their state changes and mark the task done."""
        ...

    def undelivered(self, target: int, outputs: list[Output]) -> list[Output]:
        """The records for sink output ``target`` not yet delivered by any attempt."""
        ...

    def delivered(self, target: int, outputs: list[Output], marker: str = "") -> None:
        """Mark sink records delivered (their write is visible) and end the pending delivery.

        ``marker``: a transactional delivery's (the sink partition's last, see
        :class:`~onceflow.dedup.delivery.SinkState`).
        """
        ...

    def logged_deliveries(self, target: int) -> int:
        """Deliveries of sink output ``target`` this task logged so far, over its attempts."""
        ...

    def sink_state(self, target: int) -> SinkState:
        """What earlier attempts left for this sink partition: a delivery, writers to settle."""
        ...

    def note_writer(self, target: int, identity: str, begins: bool = True) -> None:
        """Record a transactional writer before it begins (``begins=False``: forget it)."""
        ...

    def prepare_delivery(
        self, target: int, marker: str, outputs: list[Output], durable: bool = True
    ) -> None:
        """Remember a delivery about to become visible (see :mod:`onceflow.dedup.delivery`).

        ``durable`` False: the sink keeps the delivery's mark, so the record need not be
        durable before it commits when the batch's writes are (``deferred``).
        """
        ...

    def resolve_pending(self, target: int, left: PendingDelivery, committed: bool) -> None:
        """End a pending delivery: mark its IDs if it happened, else drop it."""
        ...

    def note(self, name: str, n: int) -> None:
        """Count something that happened (shown by ``onceflow status``), e.g. a source gap."""
        ...

    def confirm_outputs(self) -> None:
        """Return once what this task committed is durable, if another stage reads it.

        Called at the end of a task that ran to its end, before Spark hands its outputs on.
        """
        ...

    def close(self) -> dict[str, int]:
        """End the task; return counters for the run's metrics."""
        ...


class GuardFactory(Protocol):
    """Builds a guard for one task on the worker (pickled from the driver)."""

    def __call__(self, task: TaskRef) -> Guard:
        """A guard for this task."""
        ...


class BatchGuards(GuardFactory, Protocol):
    """A factory that must be told each micro-batch's parameters (streaming runs).

    The parameters travel to the tasks as JSON in a Spark local property (see
    :class:`onceflow.runtime.driver.compile.StreamCompiler`), so that a stage's function, pickled
    once per run, serves every micro-batch.
    """

    def for_batch(self, params: Any, durability: Any = None, recheck: bool = False) -> GuardFactory:
        """The factory for the tasks of one micro-batch (``durability``: what it waits for).

        ``recheck``: the batch may run on a Redis that lost writes of an earlier attempt.
        """
        ...

    def batch_json(self) -> str:
        """This micro-batch's part of the factory, as JSON."""
        ...

    def with_batch_json(self, text: str) -> GuardFactory:
        """The factory of the micro-batch :meth:`batch_json` described."""
        ...


class NoGuard:
    """Bounded runs: no IDs, no backup, no dedup; a failed task simply runs again."""

    mode = Guarantee.BOUNDED
    chunk_size = 0  # whole Arrow batches
    chunk_bytes = CHUNK_BYTES
    delivery = Budget(DELIVERY_RECORDS, DELIVERY_BYTES)
    limit_ms: int | None = None
    watermark: int | None = None
    previous_watermark: int | None = None
    batch_time_ms: int | None = None
    incarnation = ""
    lossy = False
    deferred = False
    recheck = False

    def open(self) -> TaskBackup:
        """Nothing was committed before."""
        return TaskBackup()

    def open_sinks(self) -> TaskBackup:
        """Nothing was backed up."""
        return TaskBackup()

    def admit(
        self,
        rows: list[InRow],
        positional: Sequence[bool] = (),
        fingerprints: Sequence[int] = (),
    ) -> Admission:
        """Everything is fresh."""
        return Admission(rows)

    def read_state(self, node: str, keys: Sequence[bytes]) -> Mapping[bytes, bytes | None]:
        """Bounded combines keep no state outside the task."""
        return {}

    def due_timers(self, node: str, watermark: int, now: int) -> Sequence[bytes]:
        """Bounded windows fire at the end of the input, from memory."""
        return ()

    def commit(
        self,
        chunk: int,
        fresh: list[InRow],
        outputs: list[Output],
        updates: Mapping[str, StateWrite],
        lanes: Mapping[str, int],
        unmarked: Collection[bytes] = frozenset(),
    ) -> set[bytes]:
        """Nothing to store."""
        return set()

    def raise_floor(self, floor_ms: int) -> None:
        """No dedup history: nothing is late."""

    def conflicting_content(self) -> set[bytes]:
        """No dedup history: no conflicts."""
        return set()

    def is_late(self, ts: int) -> bool:
        """No dedup history: nothing is late."""
        return False

    def finish(self, outputs: list[Output], changes: Mapping[str, StateWrite]) -> None:
        """Nothing to store."""

    def undelivered(self, target: int, outputs: list[Output]) -> list[Output]:
        """Everything is new."""
        return outputs

    def delivered(self, target: int, outputs: list[Output], marker: str = "") -> None:
        """Nothing to mark."""

    def logged_deliveries(self, target: int) -> int:
        """Nothing is logged."""
        return 0

    def sink_state(self, target: int) -> SinkState:
        """Nothing is remembered."""
        return SinkState()

    def note_writer(self, target: int, identity: str, begins: bool = True) -> None:
        """Nothing to remember."""

    def prepare_delivery(
        self, target: int, marker: str, outputs: list[Output], durable: bool = True
    ) -> None:
        """Nothing to remember."""

    def resolve_pending(self, target: int, left: PendingDelivery, committed: bool) -> None:
        """Nothing was remembered."""

    def note(self, name: str, n: int) -> None:
        """Nothing is counted outside the run."""

    def confirm_outputs(self) -> None:
        """Nothing was committed."""

    def close(self) -> dict[str, Any]:
        """No counters of its own."""
        return {}


def no_guard(task: TaskRef) -> Guard:
    """The bounded-run guard factory."""
    return NoGuard()


@dataclass(frozen=True)
class AtLeastOnceGuards:
    """The baseline's factory: keyed state in Redis, no IDs, no backup, no dedup.

    Each micro-batch's parameters (its watermark and time, for windows) come from the same
    place as in exactly-once runs (:func:`onceflow.dedup.batch.fix_batch_params`).
    """

    redis: RedisSettings
    namespace: str
    config: DedupConfig
    params: Any = None
    scoped: frozenset[str] = frozenset()  # stages kept per partition scope (kernel.scopes)

    def for_batch(
        self, params: Any, durability: Any = None, recheck: bool = False
    ) -> AtLeastOnceGuards:
        """The factory for the tasks of one micro-batch (at least once waits for nothing)."""
        return replace(self, params=params)

    def batch_json(self) -> str:
        """This micro-batch's part of the factory, as JSON (see :meth:`with_batch_json`)."""
        return json.dumps({"params": None if self.params is None else self.params.to_json()})

    def with_batch_json(self, text: str) -> AtLeastOnceGuards:
        """The factory of the micro-batch :meth:`batch_json` described."""
        params = json.loads(text)["params"]
        return replace(self, params=None if params is None else BatchParams.from_json(params))

    def __call__(self, task: TaskRef) -> Guard:
        """A guard for one task."""
        return AtLeastOnceGuard(self, task)


class AtLeastOnceGuard(NoGuard):
    """Keyed state in Redis, read-merge-write per chunk; a crash may apply a chunk twice."""

    mode = Guarantee.AT_LEAST_ONCE

    def __init__(self, factory: AtLeastOnceGuards, task: TaskRef) -> None:
        self.chunk_size = max(factory.config.chunk_size, AT_LEAST_ONCE_MIN_CHUNK)
        self.chunk_bytes = factory.config.chunk_bytes
        self.delivery = factory.config.delivery
        self.ks = Scopes(factory.namespace, factory.scoped).keyspace(task.stage, task.partition)
        self.client = redis_client(factory.redis, self.ks.tag)
        self.partition = task.partition
        self.round_trips = 0
        params = factory.params
        if params is not None:
            self.watermark = params.watermark
            self.previous_watermark = params.previous_watermark
            self.batch_time_ms = params.time_ms

    def read_state(self, node: str, keys: Sequence[bytes]) -> Mapping[bytes, bytes | None]:
        """Current accumulators."""
        if not keys:
            return {}
        self.round_trips += 1
        return read_state(self.client, self.ks, node, self.partition, keys)

    def due_timers(self, node: str, watermark: int, now: int) -> Sequence[bytes]:
        """Keys with a timer due."""
        self.round_trips += 1
        return due_timers(self.client, self.ks, node, self.partition, watermark, now)

    def commit(
        self,
        chunk: int,
        fresh: list[InRow],
        outputs: list[Output],
        updates: Mapping[str, StateWrite],
        lanes: Mapping[str, int],
        unmarked: Collection[bytes] = frozenset(),
    ) -> set[bytes]:
        """Write state and raise the source lanes (not atomically with anything)."""
        if any(updates.values()):
            write_state(self.client, self.ks, self.partition, updates)
            self.round_trips += 1
        if lanes and self.batch_time_ms is not None:
            keys, args = script_args.raise_lanes(self.ks, lanes, self.batch_time_ms)
            store_for(self.client).script("raise_lanes", keys, args)
            self.round_trips += 1
        return set()

    def finish(self, outputs: list[Output], changes: Mapping[str, StateWrite]) -> None:
        """Write the end-of-task state changes (windows fired and closed)."""
        if changes:
            write_state(self.client, self.ks, self.partition, changes)
            self.round_trips += 1

    def close(self) -> dict[str, Any]:
        """Round trips, for the benchmark."""
        return {"redis_round_trips": self.round_trips}
