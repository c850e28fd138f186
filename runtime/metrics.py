"""Counters gathered from tasks: a Spark accumulator of ``{name: count}``.

Names are ``<stage>/<counter>``: ``in``, ``out/<output>``, ``duplicates_dropped``,
``dead_letters`` and, per reason, ``dead_letters.<code>`` (:func:`dead_letter_counter`; the
codes of :class:`~onceflow.kernel.records.DeadLetter`), ``bloom_maybe``, ``redis_lookups`` ...
"""

from __future__ import annotations

from collections.abc import Iterable

from pyspark.accumulators import AccumulatorParam

DEAD_LETTERS = "dead_letters"
_REASON_SEPARATOR = "."
DEFERRED = "deferred_to_delivery@"  # + partition (see deferred_counter)


def dead_letter_counter(code: str) -> str:
    """The counter of a stage's dead letters with one reason code."""
    return f"{DEAD_LETTERS}{_REASON_SEPARATOR}{code}"


def dead_letter_reason(counter: str) -> str | None:
    """The reason code of a :func:`dead_letter_counter` name, else None."""
    prefix = DEAD_LETTERS + _REASON_SEPARATOR
    return counter[len(prefix) :] if counter.startswith(prefix) else None


def deferred_counter(partition: int) -> str:
    """The counter by which a task says it left sink outputs to its batch's delivery job.

    Named by the task's partition: the driver makes the delivery job's work from them
    (:func:`take_deferred`), so it delivers for exactly the stage partitions that held some.
    """
    return f"{DEFERRED}{partition}"


def split_counter(key: str, stages: Iterable[str]) -> tuple[str, str]:
    """A task counter ``<stage>/<name>`` as ``(stage, name)``.

    By the longest stage name it starts with: a sibling-fused stage's name holds a ``/``
    (``events/shuffled``); a counter of no known stage splits at its first ``/``.
    """
    for stage in sorted(stages, key=len, reverse=True):
        if key.startswith(stage) and key[len(stage) : len(stage) + 1] == "/":
            return stage, key[len(stage) + 1 :]
    stage, _, name = key.partition("/")
    return stage, name


def take_deferred(counters: dict[str, int]) -> tuple[list[tuple[str, int]], dict[str, int]]:
    """The ``(stage, partition)`` pairs :func:`deferred_counter` named, and the rest."""
    work: list[tuple[str, int]] = []
    rest: dict[str, int] = {}
    for name, n in counters.items():
        stage, _, counter = name.rpartition("/")
        if counter.startswith(DEFERRED):
            work.append((stage, int(counter[len(DEFERRED) :])))
        else:
            rest[name] = n
    return sorted(set(work)), rest


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
