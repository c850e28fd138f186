"""Counters gathered from tasks: a Spark accumulator of ``{name: count}``."""

from __future__ import annotations

from pyspark.accumulators import AccumulatorParam


class CounterParam(AccumulatorParam[dict[str, int]]):
    """Adds dictionaries of counts key by key."""

    def zero(self, value: dict[str, int]) -> dict[str, int]:
        """An empty set of counters."""
        return {}

    def addInPlace(self, left: dict[str, int], right: dict[str, int]) -> dict[str, int]:  # noqa: N802
        """Merge ``right`` into ``left``."""
        for key, n in right.items():
            left[key] = left.get(key, 0) + n
        return left
