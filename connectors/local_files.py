"""Plain file I/O shared by the file sources and sinks: shared folders, lines, Hive folders."""

from __future__ import annotations

import os
from collections.abc import Iterator
from urllib.parse import unquote

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
