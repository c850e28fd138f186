"""Plain file I/O shared by the file sources and sinks: shared folders, lines of a byte range."""

from __future__ import annotations

import os
from collections.abc import Iterator

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
