"""The combine contract the optimizer relies on.

A :class:`CombineFn` folds the values of one key: ``create`` an accumulator, ``add`` a value,
``merge`` accumulators and ``extract`` the result. Because ``merge`` exists, the optimizer may
lift a combine over its exchange (partial accumulators per partition before the shuffle, a
final merge after it). Accumulators cross process boundaries and live in Redis as keyed state,
so they must be made of plain encodable values (numbers, strings, lists, tuples, dicts).
"""

from __future__ import annotations

from typing import Any


class CombineFn:
    """Subclass and implement the four methods; set ``liftable = False`` to forbid lifting."""

    liftable: bool = True

    def create(self) -> Any:
        """Return an empty accumulator."""
        raise NotImplementedError

    def add(self, acc: Any, value: Any) -> Any:
        """Fold one value into ``acc`` and return the accumulator."""
        raise NotImplementedError

    def merge(self, left: Any, right: Any) -> Any:
        """Combine two accumulators into one."""
        raise NotImplementedError

    def extract(self, acc: Any) -> Any:
        """Turn an accumulator into the result emitted downstream."""
        return acc

    @property
    def label(self) -> str:
        """Short name shown in plans."""
        return type(self).__name__
