"""What the executor's parts share about records: the cursor, their origins, dead-letter text."""

from __future__ import annotations

import json
import traceback
from typing import Any

from onceflow.runtime.errors import RuntimeFailure, StopStage

USER_ERROR = "user_error"  # the dead-letter code of a record user code failed on


class StageFailure(RuntimeFailure):
    """User code failed and the pipeline is set to fail rather than dead-letter."""


class Cursor:
    """The parent record whose outputs are being produced, shared by a stage's ops.

    ``index``: the element of the batch under way whose dead letter may be made now
    (see :mod:`~.flow`).
    """

    __slots__ = ("index", "parent", "ts")

    def __init__(self) -> None:
        self.parent = b""
        self.ts = 0
        self.index = 0


class Origins:
    """Where the current input's source records were read (``lane@offset``), by record ID.

    Only errors and dead letters ask, so recording costs nothing per record: a lane's slice is
    kept as the lists it came in (:meth:`add_columns`), and the first lookup after new slices
    indexes them. Like a dict, a later record under the same ID wins.
    """

    __slots__ = ("_index", "_indexed", "_records", "_slices")

    def __init__(self) -> None:
        self._slices: list[tuple[list[bytes], str, list[int]]] = []
        self._index: dict[bytes, str] = {}
        self._indexed = 0  # slices already in the index
        self._records = 0

    def add(self, rid: bytes, lane: str, offset: int | None) -> None:
        """One record read at ``lane@offset``."""
        self._slices.append(([rid], lane, [offset if offset is not None else -1]))
        self._records += 1

    def add_columns(self, ids: list[bytes], lane: str, offsets: list[int]) -> None:
        """Records ``ids`` read at ``offsets`` of ``lane`` (kept as they are, not copied)."""
        self._slices.append((ids, lane, offsets))
        self._records += len(ids)

    def get(self, rid: bytes, default: str | None = None) -> str | None:
        """Where record ``rid`` was read, or ``default``."""
        slices, index = self._slices, self._index
        while self._indexed < len(slices):
            ids, lane, offsets = slices[self._indexed]
            index.update(zip(ids, (f"{lane}@{o}" for o in offsets), strict=True))
            self._indexed += 1
        return index.get(rid, default)

    def __len__(self) -> int:
        return self._records

    def clear(self) -> None:
        """Forget every record (a task bounds what it remembers, see ``MAX_ORIGINS``)."""
        self._slices.clear()
        self._index.clear()
        self._indexed = self._records = 0


def describe(value: Any, limit: int = 500) -> str:
    """A bounded printable form of a value, for dead letters."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the real error
        text = f"<unprintable {type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


def portable(value: Any, limit: int = 1 << 20) -> str:
    """A value as JSON when it is JSON-friendly (so it can be sent again), else printable."""
    return as_json(value, limit)[0]


def as_json(value: Any, limit: int = 1 << 20) -> tuple[str, bool]:
    """``(JSON, True)`` for a JSON-friendly value (it can be replayed), else a printed form."""
    try:
        return json.dumps(value), True
    except (TypeError, ValueError):
        return describe(value, limit), False


def too_large(limit: int) -> str:
    """The end of every reason a record too large to process gives."""
    return (
        f"the limit is {limit} bytes (Pipeline max_record_bytes): it is not processed; "
        "raise max_record_bytes, or make records smaller"
    )


_RUNTIME = "onceflow.runtime."


def error_text(exc: BaseException) -> str:
    """``Type: message`` plus the innermost user frame, for dead letters.

    Frames of the runtime's own code (the loop that called the function) are no user's: a
    function written in C (``int``, say) that raised has no frame to name.
    """
    frames = [
        (frame.f_code.co_filename, line)
        for frame, line in traceback.walk_tb(exc.__traceback__)
        if not str(frame.f_globals.get("__name__", "")).startswith(_RUNTIME)
    ]
    where = f" (at {frames[-1][0]}:{frames[-1][1]})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def stage_failure(node: str, elem: Any, exc: BaseException) -> RuntimeFailure:
    """What stops the stage when code fails on ``elem`` (``on_error="fail"``, or no choice).

    A :class:`~onceflow.runtime.errors.StopStage` is no record's fault: it stops the run as
    it is (a copy, caused by it). Anything else is a :class:`StageFailure` naming the record.
    """
    if isinstance(exc, StopStage):
        return type(exc)(str(exc))
    return StageFailure(f"stage {node!r} failed on {describe(elem, 200)}: {error_text(exc)}")


def letter_code(exc: BaseException) -> str:
    """The dead-letter code of a record user code failed on (see docs/guide/dead-letters.md).

    ``user_error``, unless the exception's class names its own in ``dead_letter_code`` (a
    record too late for a join is ``late_for_join``).
    """
    code = getattr(type(exc), "dead_letter_code", None)
    return code if isinstance(code, str) else USER_ERROR


def ahead_reason(ts: int, limit: int | None) -> str:
    """Why a record too far ahead of the clock is not processed."""
    hint = ""
    if limit is not None and ts > limit * 100:
        hint = " (it looks like microseconds or nanoseconds, not milliseconds)"
    return (
        f"event time {ts} is further ahead of the clock than the pipeline allows (newest "
        f"admitted: {limit}): a producer's clock is wrong{hint}; it is not processed, so it "
        "cannot move the watermark (raise EventTime.max_ahead if such times are real)"
    )
