"""User functions of the random stages of ``test_chunked_stage.py``: some raise, some of them
``StopIteration``; flat maps return lists, tuples or generators. Kept in a module of their own:
a dead letter names the user's line that raised, and these are the user's lines."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from onceflow.runtime.combine_fn import CombineFn


def num(x: Any) -> int:
    """A number standing for an element (elements are ints and tuples of them)."""
    if isinstance(x, tuple):
        return sum(num(v) for v in x)
    return int(x)


def _check(x: Any, bad: tuple[int, int]) -> int:
    n = num(x)
    m, r = bad
    if m and n % m == r:
        msg = f"bad element {x!r}"
        raise ValueError(msg)
    if n % 23 == 7:
        raise StopIteration  # out of a map: must not end the chunk's loop
    return n


def mapper(a: int, bad: tuple[int, int]) -> Callable[[Any], Any]:
    def fn(x: Any) -> Any:
        n = _check(x, bad)
        return n * a + 1 if n % 5 else (n, a)

    return fn


def timestamped(bad: tuple[int, int]) -> Callable[[Any, int], Any]:
    def fn(x: Any, ts: int) -> Any:
        return _check(x, bad) + ts % 7

    return fn


def predicate(r: int, bad: tuple[int, int]) -> Callable[[Any], Any]:
    def fn(x: Any) -> Any:
        n = _check(x, bad)
        if n % 17 == 3:
            return Truthless()
        return n % 3 != r

    return fn


class Truthless:
    """A filter's result whose truth cannot be told."""

    def __bool__(self) -> bool:
        msg = "no truth here"
        raise TypeError(msg)


def flat(bad: tuple[int, int]) -> Callable[[Any], Any]:
    def fn(x: Any) -> Any:
        n = _check(x, bad)
        k = n % 4
        if k == 3:
            return _generate(n)
        return [n + i for i in range(k)] if n % 2 else tuple(n - i for i in range(k))

    return fn


def _generate(n: int) -> Iterator[int]:
    yield n
    if n % 13 == 1:
        msg = f"generator broke at {n}"
        raise RuntimeError(msg)
    yield n + 2


def key_of(m: int, bad: tuple[int, int]) -> Callable[[Any], Any]:
    def fn(x: Any) -> Any:
        return _check(x, bad) % m

    return fn


def stamp(bad: tuple[int, int]) -> Callable[[Any], Any]:
    def fn(x: Any) -> Any:
        n = _check(x, bad)
        return 1_000 + n * 10 if n % 9 else 10**15  # far ahead: an 'ahead' letter

    return fn


class Picky(CombineFn):
    """A sum that refuses some values."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def create(self) -> int:
        return 0

    def add(self, acc: int, value: Any) -> int:
        n = num(value)
        if n % 7 == self.bad:
            msg = f"refused {value!r}"
            raise ValueError(msg)
        return acc + n

    def merge(self, left: int, right: int) -> int:
        return left + right

    def extract(self, acc: int) -> int:
        if acc % 11 == 4:
            msg = f"cannot extract {acc}"
            raise ArithmeticError(msg)
        return acc
