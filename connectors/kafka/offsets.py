"""Offset arithmetic of the Kafka source: pure functions, no clients.

Spark keeps a source's offsets as JSON in its checkpoint and compares them *as serialized
text* to decide whether a new micro-batch has data, so an offset must always serialize the
same way: :func:`canonical` orders partitions by topic, then partition number.

An offset may also hold a *tick* (:data:`TICK`): a counter the driver raises to have Spark
run a micro-batch without new records, when windows have panes due (the watermark moved past
a window's end in the last batch, or an early pane's time came). It is not a partition.
"""

from __future__ import annotations

from typing import Any

TICK = "onceflow:tick"


def partitions_of(offsets: dict[str, int]) -> dict[str, int]:
    """The topic-partition entries of an offset (without the tick)."""
    return {k: v for k, v in offsets.items() if k != TICK}


def tp_key(topic: str, partition: int) -> str:
    """The offset dictionary's key of a topic-partition: ``topic:partition``."""
    return f"{topic}:{partition}"


def split_tp(key: str) -> tuple[str, int]:
    """``(topic, partition)`` back from :func:`tp_key`."""
    topic, partition = key.rsplit(":", 1)
    return topic, int(partition)


def flat_offsets(value: Any) -> dict[str, int]:
    """A source's offsets from a checkpoint as ``{"topic:partition": offset}``, tick left out.

    Reads both the Python source's offsets (already flat) and those of Spark's own Kafka
    connector (``{"topic": {"0": offset}}``); anything else gives ``{}``.
    """
    if not isinstance(value, dict):
        return {}
    out: dict[str, int] = {}
    for key, item in value.items():
        if isinstance(item, dict):
            out.update({tp_key(key, int(p)): int(o) for p, o in item.items()})
        elif key != TICK and isinstance(item, int):
            out[key] = item
    return out


def canonical(offsets: dict[str, int]) -> dict[str, int]:
    """The same offsets, keys in a fixed order (topic, then partition number; the tick last)."""
    out = {k: int(offsets[k]) for k in sorted(partitions_of(offsets), key=split_tp)}
    if TICK in offsets:
        out[TICK] = int(offsets[TICK])
    return out


def cap_offsets(start: dict[str, int], end: dict[str, int], budget: int) -> dict[str, int]:
    """Limit ``end`` so that at most ``budget`` records are read, shared fairly by partitions.

    Shares follow each partition's lag, and every partition with records gets at least one
    while the budget allows: a partition with a backlog is never left out of a batch (it
    would look idle to the watermark while the others run ahead).
    """
    lag = {k: end[k] - start.get(k, 0) for k in end}
    total = sum(lag.values())
    if total <= budget:
        return dict(end)
    behind = [k for k in lag if lag[k] > 0]
    floor_share = 1 if len(behind) <= budget else 0
    rest = budget - floor_share * len(behind)
    share = {k: (floor_share if n > 0 else 0) for k, n in lag.items()}
    for k, n in lag.items():
        if n > 0:
            share[k] = min(n, share[k] + rest * n // total)
    leftover = budget - sum(share.values())
    # what rounding (and the floors of partitions that took all they had) left over: one
    # more record each to the partitions furthest behind, then the rest to whoever has room
    order = sorted(lag, key=lambda k: (-(lag[k] - share[k]), k))
    for k in order:
        if leftover <= 0:
            break
        if share[k] < lag[k]:
            share[k] += 1
            leftover -= 1
    for k in order:
        if leftover <= 0:
            break
        more = min(leftover, lag[k] - share[k])
        share[k] += more
        leftover -= more
    return {k: start.get(k, 0) + share[k] for k in end}
