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
from onceflow.dedup import delivery, trust
from onceflow.dedup.addressing import Addressing, KeyTable
from onceflow.dedup.admission import Admission, admit
from onceflow.dedup.batch import BatchParams
from onceflow.dedup.claims import Claimer
from onceflow.dedup.commit import commit_chunk
from onceflow.dedup.config import DedupConfig
from onceflow.dedup.delivery import (
    PendingDelivery,
    SinkState,
    log_delivered,
    receiver_name,
    resolve_logged,
)
from onceflow.dedup.durability import BatchDurability
from onceflow.dedup.session import TaskSession
from onceflow.dedup.state import due_timers, read_state, state_args
from onceflow.kernel import script_args
from onceflow.kernel.keyspace import Keyspace
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
    id_tags: int = 0  # layout 4: ID tags source stages claim their IDs on (kernel.id_tags)

    def for_batch(
        self, params: BatchParams, durability: BatchDurability | None = None
    ) -> ExactlyOnceGuards:
        """The factory for the tasks of one micro-batch (and what it waits for)."""
        if durability is None:
            return replace(self, params=params)
        return replace(
            self,
            params=params,
            wait_replicas=durability.replicas,
            servers=durability.servers,
            waitaof=durability.waitaof,
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
        )

    def __call__(self, task: TaskRef) -> ExactlyOnceGuard:
        """A guard for one task."""
        if self.params is None or self.params.batch != task.batch:
            msg = f"no parameters for micro-batch {task.batch}; this is a runner bug"
            raise RuntimeError(msg)
        return ExactlyOnceGuard(self, task, self.params)


class ExactlyOnceGuard:
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
        self.admitted: dict[bytes, int] = {}  # inputs this attempt committed -> fingerprint
        self.prints: dict[bytes, int] = {}  # fresh inputs admitted -> content fingerprint
        self.other_content: set[bytes] = set()  # the last commit's conflicts that are no copies
        self.earlier: frozenset[bytes] = frozenset()  # those earlier attempts committed
        self._admitted_counts: dict[str, int] = {}
        self.claimed: set[bytes] = set()  # the last admission's IDs claimed on ID tags
        self.claimer = _claimer(factory, task, ks, config)  # layout 4: claims on ID tags

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
        by_name = {name: index for index, name in self.sink_names.items()}
        self.delivered_ids = {
            by_name[sink]: ids for sink, ids in replay.delivered.items() if sink in by_name
        }
        return replay

    def admit(
        self,
        rows: list[InRow],
        positional: Sequence[bool] = (),
        prints: Sequence[int] = (),
        origins: Sequence[bytes | None] = (),
    ) -> Admission:
        """Which rows of a chunk are new (see :mod:`onceflow.dedup.admission`).

        Positional IDs take no seen-mark: the task's backup keeps its inputs, which tells an
        earlier attempt's apart. ``prints``: the rows' content fingerprints, which seen-marks
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
            prints,
            self.claimer,
            origins,
        )
        self.prints = adm.prints
        self.claimed = adm.claimed
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
            self.prints,
            self.claimed,
        )
        if conflicts:
            return conflicts
        if seq > 0:
            self.stage.committed(seq, s.generation)
        # positional IDs cannot come again in this attempt: not remembered
        rids = [row[1] for row in fresh if row[1] not in unmarked]
        self.admitted.update(zip(rids, map(self.prints.get, rids, repeat(0)), strict=False))
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
        s.check(reply)
        s.round_trip()
        s.pending.clear()

    def undelivered(self, target: int, outputs: list[Output]) -> list[Output]:
        """Sink records no attempt has delivered yet (the backup's delivery log says)."""
        done = self.delivered_ids.get(target)
        return [o for o in outputs if o.id not in done] if done else outputs

    def delivered(self, target: int, outputs: list[Output]) -> None:
        """Log sink records delivered (their write is visible) and end the pending delivery."""
        ids = [o.id for o in outputs]
        log_delivered(self.session, self.sink_names[target], ids)
        self.delivered_ids.setdefault(target, set()).update(ids)  # a later delivery skips them

    def _receiver_name(self, target: int) -> str:
        return receiver_name(self.sink_names[target])

    def sink_state(self, target: int) -> SinkState:
        """What earlier attempts left for this sink partition: a delivery, writers to settle."""
        return delivery.sink_state(self.session, self._receiver_name(target))

    def note_writer(self, target: int, identity: str, begins: bool = True) -> None:
        """Record a transactional writer before it begins (``begins=False``: forget it)."""
        delivery.note_writer(self.session, self._receiver_name(target), identity, begins)

    def prepare_delivery(self, target: int, marker: str, outputs: list[Output]) -> None:
        """Remember a delivery about to become visible (``marker``: ``NO_MARKER`` if plain)."""
        delivery.prepare(
            self.session,
            self._receiver_name(target),
            marker,
            [o.id for o in outputs],
            self.replicas,
            self.wait_timeout_ms,
            self.waitaof,
        )

    def resolve_pending(self, target: int, left: PendingDelivery, committed: bool) -> None:
        """End a pending delivery: log its IDs if it happened, else drop it."""
        ids = resolve_logged(self.session, self.sink_names[target], left, committed)
        self.delivered_ids.setdefault(target, set()).update(ids)

    def note(self, name: str, n: int) -> None:
        """Count something in the stage's Redis counters (written with the next commit)."""
        self.session.count_redis(name, n)

    def close(self) -> dict[str, Any]:
        """Snapshot filters whose journal grew long; return counters for the run."""
        for r in self.receivers:
            trust.snapshot(self.session, r)
        counters = {k: v for k, v in self.session.counters.items() if k not in _REDIS_ONLY}
        counters["bloom_bytes"] = sum(r.filters.memory_bytes() for r in self.receivers)
        return counters


def _claimer(
    factory: ExactlyOnceGuards, task: TaskRef, ks: Keyspace, config: DedupConfig
) -> Claimer | None:
    """Layout 4: a stage in the namespace's own tag claims its source IDs on the ID tags."""
    if not factory.id_tags or ks.scope is not None:
        return None
    redis = factory.redis
    return Claimer(
        factory.namespace,
        factory.id_tags,
        config.shards,
        task.stage,
        task.batch,
        lambda tag: redis_client(redis, tag),
        factory.servers or {},
    )
