"""CSV files as rows: ``sources.Csv(folder, watch=True)``, a folder of CSV files as a stream.

A file's records are found by Python's ``csv`` reader itself, fed a line at a time, so a quoted
field may hold the delimiter, quotes (``""``) and newlines (a record then spans lines; its
newlines are read as line feeds). Each record is then decoded alone: with a header (the file's
first record, the default) as a dict of the header's names, with ``columns=`` as a dict of
those, else as a list of strings. Values stay text: CSV has no types (``map`` them).

A record is a dead letter naming ``path@offset`` (``undecodable``) when it has more or fewer
fields than the header, is not UTF-8, or the ``csv`` reader refuses it (a quote left open at
the end of the file); the reader goes on with the next line. A record's ID is its file and
the byte offset where it starts, as for JSON lines (or ``id(row)``).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from onceflow.kernel.codec import ValueCodec

Lines = Iterator[tuple[int, "bytes | None", int]]


def _no_encode(value: Any) -> bytes:
    msg = "the csv codec reads files; it writes nothing"
    raise TypeError(msg)


@dataclass(frozen=True)
class CsvRows:
    """How a watched folder's CSV files are read (see the module docstring)."""

    header: bool = True
    columns: tuple[str, ...] | None = None
    delimiter: str = ","
    name: str = field(default="csv", init=False)

    def file(self, lines: Lines) -> tuple[Lines, ValueCodec]:
        """One file's records as ``(offset, raw record, bytes)``, and the codec that reads one.

        The header (when there is one) is read from the first record and not given out.
        """
        names: list[str] | None = list(self.columns) if self.columns else None
        holder: dict[str, list[str] | None] = {"names": names}

        wanted_header = self.header and not self.columns

        def decode(raw: bytes) -> Any:
            row = self.parse(raw)
            found = holder["names"]
            if found is None:
                if wanted_header:
                    msg = "the file's header (its first record) could not be read"
                    raise ValueError(msg)
                return row
            if len(row) != len(found):
                msg = f"{len(row)} fields, the header names {len(found)}"
                raise ValueError(msg)
            return dict(zip(found, row, strict=True))

        def records() -> Lines:
            looking = wanted_header
            for offset, raw, size in self.records(lines):
                if looking and raw is not None and raw.strip():
                    looking = False
                    try:
                        holder["names"] = self.parse(raw)
                    except ValueError:
                        yield offset, raw, size  # a letter: the header itself
                    continue
                yield offset, raw, size

        return records(), ValueCodec(self.name, decode, _no_encode)

    def parse(self, raw: bytes) -> list[str]:
        """One record's fields; ValueError says why there are none."""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            msg = f"not UTF-8: {exc}"
            raise ValueError(msg) from None
        rows = list(csv.reader(io.StringIO(text), delimiter=self.delimiter, strict=True))
        if len(rows) != 1:
            msg = f"{len(rows)} records where one was read (a quote left open?)"
            raise ValueError(msg)
        return rows[0]

    def records(self, lines: Lines) -> Lines:
        """Lines grouped into records as the ``csv`` reader reads them."""
        pending: list[tuple[int, bytes, int]] = []
        too_long: list[tuple[int, int]] = []

        def feed() -> Iterator[str]:
            for offset, line, size in lines:
                if line is None:  # over the line cap: ends the record, becomes a letter
                    too_long.append((offset, size))
                    return
                pending.append((offset, line, size))
                yield line.decode("utf-8", "surrogateescape") + "\n"

        while True:
            reader = csv.reader(feed(), delimiter=self.delimiter)
            try:
                for _row in reader:
                    yield self._take(pending)
            except csv.Error:
                if pending:
                    yield self._take(pending)  # the reader refused it: a letter, then on
                continue
            if pending:  # the file ended inside a quoted field
                yield self._take(pending)
            if not too_long:
                return
            offset, size = too_long.pop()
            yield offset, None, size  # then on with the lines after it

    @staticmethod
    def _take(pending: list[tuple[int, bytes, int]]) -> tuple[int, bytes, int]:
        offset = pending[0][0]
        raw = b"\n".join(line for _, line, _ in pending)
        size = sum(s for _, _, s in pending)
        pending.clear()
        return offset, raw, size
