"""Keyed state in Redis: one hash per stateful combine node and partition, and its timers.

Read by every streaming guard. The exactly-once commit writes it in the same atomic step as
the seen-marks (:mod:`onceflow.dedup.commit`) and the end-of-task step (``FINISH``) writes the
changes windows make when they fire and close (:func:`state_args` builds the arguments both
take); the at-least-once baseline writes it plainly (:func:`write_state`). Timers are sorted
sets per node and partition (:meth:`~onceflow.kernel.keyspace.Keyspace.timers`): windows'
event-time and processing-time timers, and the expiry of state with a time-to-live.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.records import StateWrite
from onceflow.kernel.store import store_for

if TYPE_CHECKING:
    from onceflow.dedup.addressing import KeyTable
    from onceflow.kernel.store import Connection

EVENT = "event"
PROCESSING = "processing"
DELETE = b""  # a state value or timer score that deletes (see the scripts' _WRITE_STATE)


def read_state(
    client: Connection, ks: Keyspace, node: str, partition: int, keys: Sequence[bytes]
) -> dict[bytes, bytes | None]:
    """Accumulators of ``keys`` in a stateful combine's partition (one HMGET)."""
    values = store_for(client).hmget(ks.state(node, partition), list(keys))
    return dict(zip(keys, values, strict=True))


def due_timers(
    client: Connection, ks: Keyspace, node: str, partition: int, watermark: int, now: int
) -> list[bytes]:
    """Keys of a windowed combine with a timer due (one round trip).

    Due: an event-time timer at or before ``watermark``, or a processing-time timer at or
    before ``now``.
    """
    cmds = store_for(client).batch()
    cmds.zrangebyscore(ks.timers(EVENT, node, partition), "-inf", watermark)
    cmds.zrangebyscore(ks.timers(PROCESSING, node, partition), "-inf", now)
    event, processing = cmds.execute()
    return list(dict.fromkeys([*event, *processing]))


def state_args(
    ks: Keyspace, partition: int, updates: Mapping[str, StateWrite], keys: KeyTable
) -> list[Any]:
    """The state and timer arguments of ``COMMIT`` and ``FINISH`` (adding their keys)."""
    values: list[Any] = []
    timers: list[Any] = []
    for node, write in updates.items():
        if write.values:
            index = keys.add(ks.state(node, partition))
            for kb, value in write.values.items():
                values += [index, kb, DELETE if value is None else value]
        for kind, members in write.timers.items():
            if not members:
                continue
            index = keys.add(ks.timers(kind, node, partition))
            for kb, at in members.items():
                timers += [index, kb, DELETE if at is None else at]
    return [len(values) // 3, *values, len(timers) // 3, *timers]


def write_state(
    client: Connection, ks: Keyspace, partition: int, updates: Mapping[str, StateWrite]
) -> None:
    """Write state and timers, not atomically with anything (the at-least-once baseline)."""
    cmds = store_for(client).batch()
    for node, write in updates.items():
        key = ks.state(node, partition)
        put = {kb: v for kb, v in write.values.items() if v is not None}
        gone = [kb for kb, v in write.values.items() if v is None]
        if put:
            cmds.hset_many(key, put)
        if gone:
            cmds.hdel(key, *gone)
        for kind, members in write.timers.items():
            zkey = ks.timers(kind, node, partition)
            scores = {kb: at for kb, at in members.items() if at is not None}
            dropped = [kb for kb, at in members.items() if at is None]
            if scores:
                cmds.zadd(zkey, scores)
            if dropped:
                cmds.zrem(zkey, *dropped)
    cmds.execute()
