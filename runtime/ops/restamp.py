"""The op of ``Stream.restamp``: each element passed on with a new event time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from onceflow.kernel.eventtime import as_event_time
from onceflow.runtime.ops.boundaries import Boundaries, Push
from onceflow.runtime.ops.record_text import Cursor, ahead_reason, portable
from onceflow.runtime.spec import OpSpec


def restamp_push(
    op: OpSpec,
    out: Push,
    cursor: Cursor,
    fail: Callable[[str, BaseException, Any], None],
    letters: Boundaries,
    limit: Callable[[], int | None],
) -> Push:
    """Pass each element on to ``out`` with the event time ``op.fn(element)``.

    The new time holds for everything downstream of the op (in the stage, and in the records
    it outputs); sibling ops of the same input keep the old one. A time further ahead than
    the batch admits (``EventTime.max_ahead``) makes the element a dead letter (``ahead``),
    as a failing function does (``user_error``).
    """
    assert op.fn is not None
    fn = op.fn
    name = op.name

    def push(elem: Any) -> None:
        try:
            ts = as_event_time(fn(elem))
        except Exception as exc:  # noqa: BLE001 - user code: dead-letter it
            fail(name, exc, elem)
            return
        newest = limit()
        if newest is not None and ts > newest:
            letters.letter(name, ahead_reason(ts, newest), portable(elem), "ahead")
            return
        old = cursor.ts
        cursor.ts = ts
        try:
            out(elem)
        finally:
            cursor.ts = old

    return push
