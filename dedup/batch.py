"""A micro-batch's parameters: what its dedup decisions depend on, fixed by its first attempt.

When a micro-batch starts, the driver takes the batch's time from Redis's clock (one clock
for every driver and GC), computes the pipeline watermark from the source lanes
(:func:`onceflow.kernel.eventtime.watermark`) and from them:

* the *late floor*: records whose event time falls before ``watermark - horizon`` could be
  copies of records already forgotten, so they are dead-lettered as late;
* the batch's *generation*, where its seen-IDs go: the bucket of the *dedup time*, a clock
  that advances by the smaller of the watermark's and the wall clock's advance
  (:func:`advance`), so it never jumps (the first batch runs before any event time is known;
  a backfill's watermark races ahead of the clock). All tasks of a batch share it, so copies
  committed concurrently meet in one key;
* the *live generations*: those whose newest committed event time is not older than the late
  floor. Every one is looked up, so a copy is recognised whatever timestamp it carries, as
  long as its original's event time is within the horizon; a generation whose newest event
  is older could only hold originals of late records, and is garbage;
* the newest event time admitted.

:func:`fix_batch_params` stores them unless the batch already has some: a replayed batch (a
task retry, or a driver restarted after a crash) then admits, places and dead-letters records
exactly as its first attempt did, even if the horizon was changed in between (a change
applies from the next new batch).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from onceflow.dedup.clock import BatchClock
from onceflow.dedup.config import DedupConfig
from onceflow.dedup.errors import FencedError, ServerChangedError, server_changed_message
from onceflow.kernel import script_args
from onceflow.kernel.eventtime import EventTime, watermark
from onceflow.kernel.keyspace import GC_FLOOR_FIELD, Keyspace
from onceflow.kernel.store import store_for

if TYPE_CHECKING:
    from onceflow.kernel.store import Connection


@dataclass(frozen=True)
class BatchParams:
    """What every attempt of one micro-batch decides with (see the module docstring)."""

    batch: int
    time_ms: int  # Redis's clock when the batch first started
    watermark: int  # the pipeline watermark (ms of event time)
    dedup_time_ms: int  # see the module docstring
    horizon_ms: int
    floor: int  # the late floor: oldest event-time bucket admitted
    generation: int  # the bucket of the dedup time: where the batch's seen-IDs go
    live: tuple[int, ...]  # generations still looked up, newest first (the batch's included)
    limit_ms: int  # the newest event time admitted (the batch time plus max_ahead)
    # The batch before's watermark: the windows it closed are closed (their final panes have
    # left); a window that ends between it and ``watermark`` still takes this batch's
    # records — those of event-time firings upstream (a pane's time is its window's last ms,
    # a timer's its time) among them — and fires at the end of this batch.
    # (None: a batch started by an earlier build, whose windows closed at its own watermark).
    previous_watermark: int | None = None

    @property
    def floor_ms(self) -> int:
        """The late floor as a time: the start of its bucket."""
        return self.watermark - self.horizon_ms

    def as_fields(self) -> dict[str, int | str]:
        """As the fields of the batch's Redis hash."""
        fields: dict[str, int | str] = {
            "time_ms": self.time_ms,
            "watermark": self.watermark,
            "dedup_time_ms": self.dedup_time_ms,
            "horizon_ms": self.horizon_ms,
            "floor": self.floor,
            "generation": self.generation,
            "live": ",".join(str(g) for g in self.live),
            "limit_ms": self.limit_ms,
        }
        if self.previous_watermark is not None:
            fields["previous_watermark"] = self.previous_watermark
        return fields

    @classmethod
    def from_fields(cls, batch: int, fields: Mapping[Any, Any]) -> BatchParams:
        """Back from the batch's Redis hash (``HGETALL``, bytes or str)."""
        text = {_text(k): _text(v) for k, v in fields.items()}
        f: dict[str, int] = {k: int(v) for k, v in text.items() if k != "live"}
        return cls(
            batch,
            f["time_ms"],
            f["watermark"],
            f["dedup_time_ms"],
            f["horizon_ms"],
            f["floor"],
            f["generation"],
            tuple(int(g) for g in text["live"].split(",") if g),
            f["limit_ms"],
            f.get("previous_watermark"),
        )

    def to_json(self) -> dict[str, Any]:
        """As a JSON object (the batch's guard parameters travel to tasks that way)."""
        return {"batch": self.batch, **self.as_fields()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BatchParams:
        """Back from :meth:`to_json`."""
        return cls.from_fields(int(data["batch"]), {k: v for k, v in data.items() if k != "batch"})


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def redis_time_ms(client: Connection) -> int:
    """Redis's clock, in ms."""
    return store_for(client).time_ms()


def lanes_of(client: Connection, ks: Keyspace) -> dict[str, tuple[int, int]]:
    """Each source lane's ``(largest committed event time, batch time it last had records)``."""
    cmds = store_for(client).batch()
    cmds.hgetall(ks.lanes)
    cmds.hgetall(ks.lane_activity)
    newest, seen = cmds.execute()
    return {_text(lane): (int(ts), int(seen.get(lane, 0))) for lane, ts in newest.items()}


def advance(dedup_time: int, previous_wm: int, wm: int, previous_time: int, now: int) -> int:
    """The next dedup time: moved by the smaller of the watermark's and the clock's advance."""
    return dedup_time + min(max(0, wm - previous_wm), max(0, now - previous_time))


def live_generations(
    client: Connection, ks: Keyspace, current: int, floor_ms: int
) -> tuple[int, ...]:
    """Generations whose newest event time is at or after ``floor_ms``, and ``current``."""
    newest = {
        int(_text(g)): int(_text(ts)) for g, ts in store_for(client).hgetall(ks.generations).items()
    }
    live = {g for g, ts in newest.items() if ts >= floor_ms} | {current}
    return tuple(sorted(live, reverse=True))


def fix_batch_params(
    client: Connection,
    ks: Keyspace,
    epoch: int,
    batch: int,
    config: DedupConfig,
    event_time: EventTime,
    server: str = "",
    clock: BatchClock | None = None,
) -> BatchParams:
    """The batch's parameters: stored ones if an earlier attempt fixed them, else new ones.

    ``server`` is the run id of the namespace's Redis server the batch's tasks will check
    (:mod:`onceflow.dedup.durability`): new parameters are stored only on that server.
    ``clock`` is the driver's :class:`~onceflow.dedup.clock.BatchClock` (one per run): a new
    batch's time comes from it, checked against this machine's clock.
    """
    existing = read_batch_params(client, ks, batch)
    if existing is not None:
        return existing
    cmds = store_for(client).batch()
    cmds.hgetall(ks.clock)
    cmds.hget(ks.gc, GC_FLOOR_FIELD)
    clock_fields, deleted_below = cmds.execute()
    stored = {_text(k): int(_text(v)) for k, v in clock_fields.items()}
    # batch times never go back, even if Redis's clock does (TTLs and GC rely on that)
    clock_of_run = clock or BatchClock(event_time.max_clock_skew_ms)
    now = clock_of_run.now(redis_time_ms(client), stored.get("time", 0))
    previous_wm = stored.get("watermark", 0)
    wm = watermark(lanes_of(client, ks), now, previous_wm, event_time)
    if "dedup_time" in stored:
        tau = advance(stored["dedup_time"], previous_wm, wm, stored["time"], now)
    else:  # the namespace's first batch: the dedup time starts at the wall clock
        tau = now
    generation = config.bucket(tau)
    floor = config.floor(wm)
    if deleted_below is not None:  # never below what GC may have deleted (a raised horizon)
        floor = max(floor, -(-int(_text(deleted_below)) // config.bucket_ms))
    params = BatchParams(
        batch,
        now,
        wm,
        tau,
        config.horizon_ms,
        floor,
        generation,
        # from the start of the floor bucket: admission keeps every record from there on
        # (late is per bucket), so the generations holding them must still be looked up
        live_generations(client, ks, generation, floor * config.bucket_ms),
        event_time.limit(now),
        min(previous_wm, wm),
    )
    keys, args = script_args.batch_params(
        ks, batch, epoch=epoch, server=server, clock=(wm, tau, now), fields=params.as_fields()
    )
    reply = store_for(client).script("batch_params", keys, args)
    if reply and reply[0] == b"fenced":
        if reply[1] == b"redis":
            where = f"namespace {ks.namespace!r}"
            raise ServerChangedError(server_changed_message(where, batch))
        msg = f"another driver of namespace {ks.namespace!r} started; this driver stops"
        raise FencedError(msg)
    return BatchParams.from_fields(batch, dict(zip(reply[::2], reply[1::2], strict=True)))


def read_batch_params(client: Connection, ks: Keyspace, batch: int) -> BatchParams | None:
    """The parameters a batch was started with, if it was."""
    fields = store_for(client).hgetall(ks.batch(batch))
    return BatchParams.from_fields(batch, fields) if fields else None
