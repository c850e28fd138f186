"""Joining two keyed streams per key and event-time window (Beam's CoGroupByKey).

Both sides are tagged, merged, windowed and folded by one combine whose accumulator keeps
each side's values of a key and window; when the window fires (the watermark passes its
end) its two lists come out together, once. So a join is as exactly-once as any windowed
combine: its state is keyed window state, committed with the seen-marks, and its output is
backed up before it is sent on. The state a join keeps is every value of both sides of each
open window, and it ends with the window.

A join's windows fire once (no early or late panes, which would emit pairs again): a record
that arrives after its window fired is a ``window_closed`` dead letter. To wait longer for
stragglers, allow more out-of-orderness (``EventTime.of(out_of_orderness=...)``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

from onceflow.kernel.durations import Duration
from onceflow.kernel.windows import Global, Pane, WindowFn
from onceflow.pipeline.errors import PipelineError
from onceflow.pipeline.key_types import KeySides, check_declared
from onceflow.runtime.combine_fn import CombineFn

# The streams are onceflow.pipeline.api.Stream objects (typed as Any here: that module calls
# this one, and the layer test allows no cycle, even for type hints).
Stream = Any

HOW = ("inner", "left", "right", "outer")


class CoGroup(NamedTuple):
    """One key's values of both sides in one window ``[start, end)`` (ms)."""

    left: list[Any]
    right: list[Any]
    start: int
    end: int


class _BothSides(CombineFn):
    """Keeps the values of each side: ``[left values, right values]``."""

    def create(self) -> Any:
        return [[], []]

    def add(self, acc: Any, value: Any) -> Any:
        side, item = value
        acc[side].append(item)
        return acc

    def merge(self, left: Any, right: Any) -> Any:
        return [left[0] + right[0], left[1] + right[1]]

    @property
    def label(self) -> str:
        return "both sides"


def _tag(side: int) -> Any:
    return lambda v: (side, v)


def co_group(left: Stream, name: str, right: Stream, windows: WindowFn | Duration) -> Stream:
    """``(key, CoGroup)`` for every key and window with a value on either side."""
    for stream in (left, right):
        stream._need_keyed(name, "co_group")  # noqa: SLF001 - same package
        if stream.windowing is not None:
            msg = (
                f"co_group/join {name!r}: stream {stream.name!r} is already windowed; pass "
                "the windows to the join instead"
            )
            raise PipelineError(msg)
    if isinstance(windows, Global):
        msg = (
            f"co_group/join {name!r}: a Global window never closes; join per fixed, "
            "sliding or session windows"
        )
        raise PipelineError(msg)
    join_name, names = f"co_group/join {name!r}", (repr(left.name), repr(right.name))
    check_declared(join_name, names, (left.key_kind, right.key_kind))
    sides = KeySides(join_name, names)
    tagged = left.pipeline.merge(
        f"{name}.both",
        left.map_values(f"{name}.left", _tag(0)),
        right.map_values(f"{name}.right", _tag(1)),
    )
    grouped = tagged.window(f"{name}.window", windows).combine_per_key(
        f"{name}.group", _BothSides()
    )
    out = grouped._flat(name, "co_group", _co_groups(sides), keyed=True)  # noqa: SLF001
    out.key_kind = left.key_kind
    return out


def _co_groups(sides: KeySides) -> Any:
    """``(key, Pane)`` to ``(key, CoGroup)``, noting the key of a one-sided group as its side's.

    Keys of both sides meet after the shuffle only: a key with values on one side only is
    what the check of :mod:`~onceflow.pipeline.key_types` compares.
    """

    def co_groups(kv: tuple[Any, Pane]) -> Iterator[tuple[Any, CoGroup]]:
        key, pane = kv
        lefts, rights = pane.value
        if not rights or not lefts:
            sides.see(0 if lefts else 1, key)
        yield key, CoGroup(lefts, rights, pane.start, pane.end)

    return co_groups


def join(
    left: Stream, name: str, right: Stream, windows: WindowFn | Duration, how: str = "inner"
) -> Stream:
    """``(key, (left value, right value))`` for every pair of one key in one window.

    ``how`` = ``"left"`` also gives ``(key, (left value, None))`` for a left value with no
    right one in its window, ``"right"`` the other way round, ``"outer"`` both.
    """
    if how not in HOW:
        msg = f"join {name!r}: how={how!r} is not one of {', '.join(HOW)}"
        raise PipelineError(msg)
    keep_left = how in ("left", "outer")
    keep_right = how in ("right", "outer")

    def pairs(kv: tuple[Any, CoGroup]) -> Iterator[tuple[Any, tuple[Any, Any]]]:
        key, group = kv
        if group.left and group.right:
            for a in group.left:
                for b in group.right:
                    yield key, (a, b)
        elif group.left and keep_left:
            for a in group.left:
                yield key, (a, None)
        elif group.right and keep_right:
            for b in group.right:
                yield key, (None, b)

    grouped = co_group(left, f"{name}.cogroup", right, windows)
    return grouped._flat(name, f"{how} join", pairs, keyed=True)  # noqa: SLF001
