"""Keyed state in Redis: one hash per stateful combine node and partition.

Read by every streaming guard. The exactly-once commit writes it in the same atomic step as
the seen-marks (:mod:`onceflow.dedup.commit`); the at-least-once baseline writes it plainly
(:func:`write_state`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from onceflow.kernel.keyspace import Keyspace


def read_state(
    client: Any, ks: Keyspace, node: str, partition: int, keys: Sequence[bytes]
) -> dict[bytes, bytes | None]:
    """Accumulators of ``keys`` in a stateful combine's partition (one HMGET)."""
    values = client.hmget(ks.state(node, partition), list(keys))
    return dict(zip(keys, values, strict=True))


def write_state(
    client: Any, ks: Keyspace, partition: int, updates: Mapping[str, Mapping[bytes, bytes]]
) -> None:
    """Write new accumulators, not atomically with anything (the at-least-once baseline)."""
    pipe = client.pipeline(transaction=False)
    for node, values in updates.items():
        if values:
            pipe.hset(ks.state(node, partition), mapping=dict(values))
    pipe.execute()
