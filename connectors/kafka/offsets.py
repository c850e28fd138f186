"""Offset arithmetic of the Kafka source: pure functions, no clients.

Spark keeps a source's offsets as JSON in its checkpoint and compares them *as serialized
text* to decide whether a new micro-batch has data, so an offset must always serialize the
same way: :func:`canonical` orders partitions by topic, then partition number.
"""

from __future__ import annotations


def tp_key(topic: str, partition: int) -> str:
    """The offset dictionary's key of a topic-partition: ``topic:partition``."""
    return f"{topic}:{partition}"


def split_tp(key: str) -> tuple[str, int]:
    """``(topic, partition)`` back from :func:`tp_key`."""
    topic, partition = key.rsplit(":", 1)
    return topic, int(partition)


def canonical(offsets: dict[str, int]) -> dict[str, int]:
    """The same offsets, keys in a fixed order (topic, then partition number)."""
    return {k: int(offsets[k]) for k in sorted(offsets, key=split_tp)}


def cap_offsets(start: dict[str, int], end: dict[str, int], budget: int) -> dict[str, int]:
    """Limit ``end`` so that at most ``budget`` records are read, shared fairly by partitions."""
    lag = {k: end[k] - start.get(k, 0) for k in end}
    total = sum(lag.values())
    if total <= budget:
        return dict(end)
    share = {k: budget * n // total for k, n in lag.items()}
    leftover = budget - sum(share.values())
    for k in sorted(lag, key=lambda k: (-(lag[k] - share[k]), k)):
        if leftover <= 0:
            break
        if share[k] < lag[k]:
            share[k] += 1
            leftover -= 1
    return {k: start.get(k, 0) + share[k] for k in end}
