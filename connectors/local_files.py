"""What the file sources and sinks share: shared folders, reading and decoding lines."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from onceflow.kernel import ids
from onceflow.kernel.eventtime import as_event_time
from onceflow.kernel.records import DeadLetter, Record

if TYPE_CHECKING:
    from onceflow.connectors.decoded import Decoded
    from onceflow.kernel.codec import ValueCodec

SHARED_DIRS_ENV = "ONCEFLOW_SHARED_DIRS"


def is_shared(path: str) -> bool:
    """Whether ``path`` lies in a folder ``$ONCEFLOW_SHARED_DIRS`` says every machine mounts."""
    full = os.path.abspath(path)
    folders = [f for f in os.environ.get(SHARED_DIRS_ENV, "").split(os.pathsep) if f]
    return any(
        os.path.commonpath([full, os.path.abspath(f)]) == os.path.abspath(f) for f in folders
    )


def read_range(path: str, start: int, end: int) -> Iterator[tuple[int, bytes]]:
    """``(offset, line)`` for every line starting in ``[start, end)``, without its newline."""
    with open(path, "rb") as fh:
        if start > 0:
            fh.seek(start - 1)
            fh.readline()  # finish the line that started before this range
        pos = fh.tell()
        while pos < end:
            line = fh.readline()
            if not line:
                return
            yield pos, line.rstrip(b"\r\n")
            pos += len(line)


def hive_values(folder: str, path: str) -> dict[str, str]:
    """``{"user": "u1"}`` from a file's folders below ``folder`` named ``user=u1`` (Hive style)."""
    below = os.path.relpath(os.path.dirname(path), folder)
    pairs = [part.split("=", 1) for part in below.split(os.sep) if "=" in part]
    return {unquote(k): unquote(v) for k, v in pairs}


def read_lines(path: str, end: int, cap: int) -> Iterator[tuple[int, bytes | None, int]]:
    """``(offset, line, bytes)`` of every line starting before ``end``; ``None`` over ``cap``.

    Nothing at or after ``end`` is read into a line (a line that runs on past it, in a file that
    grew, ends there). A line longer than ``cap`` is skipped a MiB at a time, never read whole.
    """
    with open(path, "rb") as fh:
        pos = 0
        while pos < end:
            line = fh.readline(min(cap + 1, end - pos))
            if not line:
                return
            if len(line) > cap and not line.endswith(b"\n"):  # over the cap (not at ``end``)
                size = len(line)
                while not line.endswith(b"\n"):
                    line = fh.readline(1 << 20)
                    if not line:
                        break
                    size += len(line)
                yield pos, None, size
                pos += size
                continue
            yield pos, line.rstrip(b"\r\n"), len(line)
            pos += len(line)


def decode_line(  # noqa: PLR0913 - one line, where it came from and how to read it
    source: str,
    path: str,
    offset: int,
    line: bytes,
    codec: ValueCodec,
    with_ids: bool,
    ts_fn: Callable[[Any], Any] | None = None,
    *,
    id_fn: Callable[[Any], Any] | None = None,
    lane: str | None = None,
    default_ts: int = 0,
) -> Decoded:
    """One line of a file as a record, or a dead letter naming ``path@offset``.

    Its ID is its file and offset, or ``id_fn(value)``'s key (then with the line's checksum,
    so another line under the same ID is an ID conflict, not a copy); its event time
    ``ts_fn(value)``, else ``default_ts``; its lane ``lane``, else the file.
    """
    where = f"{path}@{offset}"
    rid = ids.from_position(source, path, 0, offset) if with_ids else b""
    try:
        value = codec.decode(line)
    except Exception as exc:  # noqa: BLE001 - undecodable input becomes a dead letter
        error = f"cannot decode as {codec.name}: {type(exc).__name__}: {exc}"
        return DeadLetter(rid, 0, source, error, where, raw=line, code="undecodable")
    printed = 0
    if with_ids and id_fn is not None:
        try:
            rid = ids.from_user_key(id_fn(value))
        except Exception as exc:  # noqa: BLE001 - the user's id function failed
            error = f"no record ID: {type(exc).__name__}: {exc}"
            return DeadLetter(rid, 0, source, error, where, raw=line, code="no_id")
        printed = checksum(line)
    try:
        ts = as_event_time(ts_fn(value)) if ts_fn is not None else default_ts
    except Exception as exc:  # noqa: BLE001 - the user's timestamp function failed
        error = f"no event time: {type(exc).__name__}: {exc}"
        return DeadLetter(rid, 0, source, error, where, raw=line, code="no_time")
    return Record(rid, ts, value, path if lane is None else lane, offset, False, len(line), printed)


def checksum(data: bytes) -> int:
    """A record's content checksum (see :class:`~onceflow.kernel.records.Record`); never 0."""
    from crc32c import crc32c

    return crc32c(data) or 1
