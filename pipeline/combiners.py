"""Built-in combiners for ``combine_per_key``; all but :class:`ToList` can be lifted."""

from __future__ import annotations

from typing import Any

from onceflow.pipeline.errors import PipelineError
from onceflow.runtime.combine_fn import CombineFn

__all__ = ["CombineFn", "Count", "Max", "Mean", "Min", "Sum", "ToList", "resolve"]


class Sum(CombineFn):
    """Sum of the values."""

    def create(self) -> Any:
        """Zero."""
        return 0

    def add(self, acc: Any, value: Any) -> Any:
        """Add the value."""
        return acc + value

    def merge(self, left: Any, right: Any) -> Any:
        """Add two sums."""
        return left + right


class Count(CombineFn):
    """Number of values."""

    def create(self) -> int:
        """Zero."""
        return 0

    def add(self, acc: int, value: Any) -> int:
        """One more."""
        return acc + 1

    def merge(self, left: int, right: int) -> int:
        """Add two counts."""
        return left + right


class Min(CombineFn):
    """Smallest value (None for a key with no values)."""

    def create(self) -> Any:
        """No value yet."""
        return None

    def add(self, acc: Any, value: Any) -> Any:
        """Keep the smaller."""
        return value if acc is None or value < acc else acc

    def merge(self, left: Any, right: Any) -> Any:
        """Smaller of two minima."""
        if left is None:
            return right
        return left if right is None or left <= right else right


class Max(CombineFn):
    """Largest value (None for a key with no values)."""

    def create(self) -> Any:
        """No value yet."""
        return None

    def add(self, acc: Any, value: Any) -> Any:
        """Keep the larger."""
        return value if acc is None or value > acc else acc

    def merge(self, left: Any, right: Any) -> Any:
        """Larger of two maxima."""
        if left is None:
            return right
        return left if right is None or left >= right else right


class Mean(CombineFn):
    """Arithmetic mean; the accumulator is ``[sum, count]``."""

    def create(self) -> list[float]:
        """Empty."""
        return [0, 0]

    def add(self, acc: list[float], value: Any) -> list[float]:
        """Fold one value."""
        return [acc[0] + value, acc[1] + 1]

    def merge(self, left: list[float], right: list[float]) -> list[float]:
        """Add sums and counts."""
        return [left[0] + right[0], left[1] + right[1]]

    def extract(self, acc: list[float]) -> float | None:
        """Sum over count (None when empty)."""
        return acc[0] / acc[1] if acc[1] else None


class ToList(CombineFn):
    """All values in a list (``group_by_key``). Not lifted: partial lists save no shuffle."""

    liftable = False

    def create(self) -> list[Any]:
        """Empty list."""
        return []

    def add(self, acc: list[Any], value: Any) -> list[Any]:
        """Append."""
        acc.append(value)
        return acc

    def merge(self, left: list[Any], right: list[Any]) -> list[Any]:
        """Concatenate."""
        return left + right


_BUILTIN: dict[str, type[CombineFn]] = {
    "sum": Sum,
    "count": Count,
    "min": Min,
    "max": Max,
    "mean": Mean,
    "list": ToList,
}


def resolve(fn: CombineFn | str) -> CombineFn:
    """A CombineFn from an instance or a built-in name (``sum``, ``count``, ...)."""
    if isinstance(fn, CombineFn):
        return fn
    if isinstance(fn, str) and fn.lower() in _BUILTIN:
        return _BUILTIN[fn.lower()]()
    if isinstance(fn, type) and issubclass(fn, CombineFn):
        msg = f"pass an instance, {fn.__name__}(), not the class {fn.__name__}"
        raise PipelineError(msg)
    known = ", ".join(_BUILTIN)
    msg = f"unknown combiner {fn!r}; pass a CombineFn instance or one of: {known}"
    raise PipelineError(msg)
