"""The exactly-once guard: the task hooks of :mod:`onceflow.runtime.guard`, backed by Redis.

For one stage, micro-batch and partition it composes the receiving side's steps:

* ``open``: claim the stage partition for this attempt (a newer attempt fences an older one;
  an older one that starts late is refused; a Redis server other than the one the batch
  started on refuses every write, see :mod:`~.durability`), read the task's backup (replayed, never
  recomputed; it also says which inputs earlier attempts committed and what they delivered) and
  make every receiver's Bloom filters trustworthy (:mod:`~.trust`);
* ``admit``: Bloom first, Redis only for "maybe"s; late records and records too far ahead
  of the clock are returned as such, inputs an earlier attempt committed as replayed
  (:mod:`~.admission`);
* ``commit``: one atomic Lua call marks the IDs seen and stores outputs and state
  (:mod:`~.commit`);
* sinks: ``undelivered`` skips what an earlier attempt delivered, ``delivered`` logs what the
  sink acknowledged in the task's backup (:mod:`~.delivery`);
* ``close``: snapshot filters whose journal grew long.

The stage itself is the one receiver (its inputs' seen-IDs and Bloom filters).
Everything a micro-batch decides with (floor, generation, time) comes from its
:class:`~onceflow.dedup.batch.BatchParams`, fixed by its first attempt.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import repeat
from typing import Any

from onceflow.backup import store as backup
from onceflow.backup.format import TaskBackup
from onceflow.dedup import trust
from onceflow.dedup.addressing import Addressing, KeyTable
from onceflow.dedup.admission import Admission, admit
from onceflow.dedup.batch import BatchParams
from onceflow.dedup.commit import commit_chunk
from onceflow.dedup.config import DedupConfig
from onceflow.dedup.delivery import TaskDeliveries
from onceflow.dedup.durability import BatchDurability, check_wait, check_waitaof
from onceflow.dedup.session import TaskSession
from onceflow.dedup.state import due_timers, read_state, state_args
from onceflow.kernel import script_args
from onceflow.kernel.records import Guarantee, InRow, Output, StateWrite, TaskRef
from onceflow.kernel.scopes import Scopes
from onceflow.kernel.settings import RedisSettings, redis_client
from onceflow.kernel.store import store_for

# Counted in Redis only (status shows them); the task counts its own for the run's summary.
_REDIS_ONLY = frozenset({"in", "duplicates", "late", "ahead", "committed", "out"})


@dataclass(frozen=True)
class ExactlyOnceGuards:
    """Guard factory for one driver epoch and micro-batch (pickled to the workers)."""

    redis: RedisSettings
    namespace: str
    epoch: int
    config: DedupConfig
    params: BatchParams | None = None
    # per hash tag: replicas a sink's pending delivery must reach before it is visible
    wait_replicas: Mapping[str, int] | None = None
    wait_timeout_ms: int = 10_000
    # the run id of each hash tag's master when the batch started (tasks write nowhere else)
    servers: Mapping[str, str] | None = None
    waitaof: bool = False  # a pending delivery is visible only once WAITAOF confirmed it
    scoped: frozenset[str] = frozenset()  # stages kept per partition scope (kernel.scopes)
    parallelism: int = 1  # partitions of a scoped stage (they share the seen-ID shards out)
    feeds: frozenset[str] = frozenset()  # stages other stages read (see confirm_outputs)
    incarnation: str = ""  # the namespace's (new at each reset), in sinks' delivery marks
    # Redis may lose a pending delivery a sink committed: marks carry their records' digest
    lossy: bool = False
    deferred: bool = False  # group commit: sinks deliver after the batch's one durable wait
    recheck: bool = False  # this attempt may run on a Redis that went back: ask the sinks
    # (the three are the batch's: see for_batch)

    def for_batch(
        self,
        params: BatchParams,
        durability: BatchDurability | None = None,
        recheck: bool = False,
    ) -> ExactlyOnceGuards:
        """The factory for the tasks of one micro-batch (and what it waits for).

        ``recheck``: the batch may run on a Redis that lost writes of an earlier attempt of
        it (see :mod:`onceflow.runtime.task.sink_delivery`).
        """
        if durability is None:
            return replace(self, params=params, recheck=recheck)
        return replace(
            self,
            params=params,
            wait_replicas=durability.replicas,
            servers=durability.servers,
            waitaof=durability.waitaof,
            recheck=recheck,
            deferred=durability.waitaof,  # one WAITAOF per batch, then the sinks deliver
            lossy=durability.unconfirmed or durability.waitaof,
        )

    def batch_json(self) -> str:
        """This micro-batch's part of the factory, as JSON (see :meth:`with_batch_json`)."""
        if self.params is None:
            msg = "no micro-batch parameters to send; this is a runner bug"
            raise RuntimeError(msg)
        return json.dumps(
            {
                "params": self.params.to_json(),
                "replicas": dict(self.wait_replicas or {}),
                "servers": dict(self.servers or {}),
                "waitaof": self.waitaof,
                "recheck": self.recheck,
                "deferred": self.deferred,
                "lossy": self.lossy,
            }
        )

    def with_batch_json(self, text: str) -> ExactlyOnceGuards:
        """The factory of the micro-batch :meth:`batch_json` described."""
        data = json.loads(text)
        return replace(
            self,
            params=BatchParams.from_json(data["params"]),
            wait_replicas=data["replicas"],
            servers=data["servers"],
            waitaof=data["waitaof"],
            recheck=data["recheck"],
            deferred=data["deferred"],
            lossy=data["lossy"],
        )

    def __call__(self, task: TaskRef) -> ExactlyOnceGuard:
        """A guard for one task."""
        if self.params is None or self.params.batch != task.batch:
            msg = f"no parameters for micro-batch {task.batch}; this is a runner bug"
            raise RuntimeError(msg)
        return ExactlyOnceGuard(self, task, self.params)


class ExactlyOnceGuard(TaskDeliveries):
    """Exactly-once hooks of one task (see the module docstring)."""

    mode = Guarantee.EXACTLY_ONCE

    def __init__(self, factory: ExactlyOnceGuards, task: TaskRef, params: BatchParams) -> None:
        scopes = Scopes(factory.namespace, factory.scoped)
        ks = scopes.keyspace(task.stage, task.partition)
        client = redis_client(factory.redis, ks.tag)
        config = factory.config
        if ks.scope is not None:  # one partition's share of the shards and Bloom capacity
            config = config.for_scope(factory.parallelism)
        self.config = config
        self.replicas = (factory.wait_replicas or {}).get(ks.tag, 0)
        self.wait_timeout_ms = factory.wait_timeout_ms
        self.waitaof = factory.waitaof
        self.incarnation = factory.incarnation
        self.lossy = factory.lossy
        self.deferred = factory.deferred
        self.recheck = factory.recheck
        self.batch = task.batch
        self.confirms = _confirms_outputs(factory, task.stage, self.replicas)
        self.unconfirmed = True  # writes (this attempt's, or the backup's) no wait covered
        self.chunk_size = factory.config.chunk_size
        self.chunk_bytes = factory.config.chunk_bytes
        self.delivery = factory.config.delivery
        self.params = params
        self.limit_ms: int | None = params.limit_ms
        self.watermark: int | None = params.watermark
        self.previous_watermark: int | None = params.previous_watermark
        self.batch_time_ms: int | None = params.time_ms
        self.attempt_id = task.attempt_id
        self.session = TaskSession(
            store_for(client),
            ks,
            config,
            str(factory.epoch),
            task.stage,
            task.batch,
            task.partition,
            server=(factory.servers or {}).get(ks.tag, ""),
            floor=params.floor,
            generation=params.generation,
            live=params.live,
            limit_ms=params.limit_ms,
        )
        self.addressing = Addressing(ks, config)
        self.stage = trust.Receiver(ks.tag, task.stage, self.config)
        self.sink_names = dict(task.sinks)  # output index -> sink name
        self.delivered_ids: dict[int, set[bytes]] = {}  # what earlier attempts delivered
        self.logged: dict[int, int] = {}  # deliveries logged in this task's backup, per sink
        self.admitted: dict[bytes, int] = {}  # inputs this attempt committed -> fingerprint
        self.fingerprints: dict[bytes, int] = {}  # fresh inputs admitted -> content fingerprint
        self.other_content: set[bytes] = set()  # the last commit's conflicts that are no copies
        self.earlier: frozenset[bytes] = frozenset()  # those earlier attempts committed
        self._admitted_counts: dict[str, int] = {}
        self.sinks_only = False  # opened to deliver what the backup holds (open_sinks)

    @property
    def receivers(self) -> list[trust.Receiver]:
        """The receivers whose Bloom filters this task keeps: the stage's own."""
        return [self.stage]

    def open(self) -> TaskBackup:
        """Claim the partition, read the backup, make the filters trustworthy."""
        s = self.session
        ks = s.ks
        s.token = f"{s.epoch}:{self.attempt_id}"
        cmds = s.store.batch()
        keys, args = script_args.claim(s.fence)
        cmds.script("claim", keys, args)
        cmds.hgetall(ks.backup(s.stage, s.batch, s.partition))
        for r in self.receivers:
            cmds.get(ks.filter_seq(r.name))
            cmds.hget(ks.filter_snapshot(r.name), trust.SEQ_FIELD)
        cmds.hkeys(ks.generations)
        cmds.info("server")  # the instance the filters are caught up against (its run_id)
        replies = cmds.execute()
        s.round_trip()
        s.check(replies[0])
        for n, r in enumerate(self.receivers):
            r.redis_seq = int(replies[2 + 2 * n] or 0)
            r.snapshot_seq = int(replies[3 + 2 * n] or 0)
        s.stored = frozenset(int(g) for g in replies[-2])
        trust.catch_up(s, self.receivers, str(replies[-1].get("run_id", "")))
        replay = backup.replay(replies[1])
        self.earlier = replay.inputs
        self.note_deliveries(replay)
        return replay

    def open_sinks(self) -> TaskBackup:
        """Claim the partition and read the backup, to deliver what it holds for the sinks.

        For a micro-batch's delivery job (``onceflow.runtime.task.deferred``): nothing is
        admitted, so the stage's Bloom filters are neither loaded nor snapshotted.
        """
        s = self.session
        s.token = f"{s.epoch}:{self.attempt_id}"
        self.sinks_only = True
        cmds = s.store.batch()
        keys, args = script_args.claim(s.fence)
        cmds.script("claim", keys, args)
        cmds.hgetall(s.ks.backup(s.stage, s.batch, s.partition))
        replies = cmds.execute()
        s.round_trip()
        s.check(replies[0])
        replay = backup.replay(replies[1])
        self.note_deliveries(replay)
        return replay

    def admit(
        self,
        rows: list[InRow],
        positional: Sequence[bool] = (),
        fingerprints: Sequence[int] = (),
    ) -> Admission:
        """Which rows of a chunk are new (see :mod:`onceflow.dedup.admission`).

        Positional IDs take no seen-mark: the task's backup keeps its inputs, which tells an
        earlier attempt's apart. ``fingerprints``: the rows' content fingerprints, which seen-marks
        of source records hold.
        """
        adm, self._admitted_counts = admit(
            self.session,
            self.stage,
            self.addressing,
            self.admitted,
            rows,
            self.earlier,
            positional,
            fingerprints,
        )
        self.fingerprints = adm.fingerprints
        return adm

    def raise_floor(self, floor_ms: int) -> None:
        """GC deleted seen-IDs of records older than ``floor_ms``: they are late from now on.

        See :class:`~onceflow.dedup.commit.FloorRaised`. Late is per bucket, as admission
        decides it: the floor's bucket is the first one admitted.
        """
        s = self.session
        s.floor = max(s.floor, -(-floor_ms // self.config.bucket_ms))

    def is_late(self, ts: int) -> bool:
        """Whether a record of event time ``ts`` is older than the dedup floor."""
        return ts // self.config.bucket_ms < self.session.floor

    def read_state(self, node: str, keys: Sequence[bytes]) -> Mapping[bytes, bytes | None]:
        """Current accumulators of ``keys`` for a stateful combine of this partition."""
        if not keys:
            return {}
        s = self.session
        s.round_trip()
        return read_state(s.store, s.ks, node, s.partition, keys)

    def commit(
        self,
        chunk: int,
        fresh: list[InRow],
        outputs: list[Output],
        updates: Mapping[str, StateWrite],
        lanes: Mapping[str, int],
        unmarked: Collection[bytes] = frozenset(),
    ) -> set[bytes]:
        """Atomically mark ``fresh`` seen and store outputs and state; see :mod:`~.commit`.

        ``unmarked`` (positional IDs) are committed as the task's inputs, without seen-marks.
        """
        if not fresh and not outputs and not any(updates.values()) and not lanes:
            return set()
        s = self.session
        seq, conflicts, self.other_content = commit_chunk(
            s,
            self.addressing,
            chunk,
            fresh,
            outputs,
            updates,
            lanes,
            self.params.time_ms,
            unmarked,
            self.fingerprints,
        )
        self.unconfirmed = True
        if conflicts:
            return conflicts
        if seq > 0:
            self.stage.committed(seq, s.generation)
        # positional IDs cannot come again in this attempt: not remembered
        rids = [row[1] for row in fresh if row[1] not in unmarked]
        self.admitted.update(zip(rids, map(self.fingerprints.get, rids, repeat(0)), strict=False))
        return set()

    def conflicting_content(self) -> set[bytes]:
        """IDs among the last commit's conflicts whose seen-mark holds other content."""
        return self.other_content

    def due_timers(self, node: str, watermark: int, now: int) -> list[bytes]:
        """Keys of a windowed combine of this partition with a timer due."""
        s = self.session
        s.round_trip()
        return due_timers(s.store, s.ks, node, s.partition, watermark, now)

    def finish(self, outputs: list[Output], changes: Mapping[str, StateWrite]) -> None:
        """Store the end-of-task outputs and mark the task done, in one step.

        The state changes that go with the outputs (panes fired, closed windows deleted) are
        part of the same step.
        """
        s = self.session
        s.count("out", sum(1 for o in outputs if o.target >= 0))
        fence = s.fence
        keys = KeyTable(
            [*fence.keys, s.ks.backup(s.stage, s.batch, s.partition), s.ks.stats(s.stage)]
        )
        writes = state_args(s.ks, s.partition, changes, keys)
        reply = backup.finish(s.store, fence, keys.keys, outputs, writes, s.pending)
        self.unconfirmed = True
        s.check(reply)
        s.round_trip()
        s.pending.clear()

    def confirm_outputs(self) -> None:
        """Wait until the task's commits are durable, if a reader needs it (confirm_writes)."""
        if self.confirms and self.unconfirmed:
            confirm_writes(self.session, self.replicas, self.waitaof, self.wait_timeout_ms)
            self.unconfirmed = False

    def note(self, name: str, n: int) -> None:
        """Count something in the stage's Redis counters (written with the next commit)."""
        self.session.count_redis(name, n)

    def close(self) -> dict[str, Any]:
        """Snapshot filters whose journal grew long; return counters for the run."""
        for r in self.receivers if not self.sinks_only else ():
            trust.snapshot(self.session, r)
        counters = {k: v for k, v in self.session.counters.items() if k not in _REDIS_ONLY}
        counters["bloom_bytes"] = sum(r.filters.memory_bytes() for r in self.receivers)
        return counters


def confirm_writes(s: TaskSession, replicas: int, waitaof: bool, timeout_ms: int) -> None:
    """Return once a task's writes are as durable as the end-of-batch wait makes them.

    Stages commit on the masters of their own hash tags. A stage that reads this one (after
    an exchange) may commit on another master, which the run-id fence does not order with
    this one's: if this master then lost the commits the outputs came from (a failover before
    replication, a host crash before the fsync), the task would run again and a
    non-deterministic function give other outputs, while the reader kept what it committed of
    the first ones. So Spark must not hand the outputs on before ``WAIT``/``WAITAOF``, on the
    task's connection after a fenced write (its own claim again), say they are durable.
    """
    cmds = s.store.batch()  # one connection: a write, then waits that cover every one before
    keys, args = script_args.claim(s.fence)
    cmds.script("claim", keys, args)
    if waitaof:
        cmds.waitaof(timeout_ms)
    if replicas:
        cmds.wait(replicas, timeout_ms)
    replies = cmds.execute()
    s.round_trip()
    s.check(replies[0])
    what = f"stage {s.stage!r}'s commits of micro-batch {s.batch}, partition {s.partition}"
    if waitaof:
        check_waitaof(replies[1], what, timeout_ms)
    if replicas:
        check_wait(replies[-1], replicas, what, timeout_ms)


def _confirms_outputs(factory: ExactlyOnceGuards, stage: str, replicas: int) -> bool:
    """Whether a task of ``stage`` waits for its commits before its readers read them.

    When another stage reads it, the batch waits for anything (replicas, fsync) and the
    pipeline's hash tags are on more than one master (see :func:`confirm_writes`): one server
    orders every write, and a sink's delivery that waited after the last commit covers it.
    """
    masters = set((factory.servers or {}).values())
    return stage in factory.feeds and len(masters) > 1 and bool(replicas or factory.waitaof)
