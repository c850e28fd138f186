"""Cutting a task's input into chunks, by records and by bytes, alike on every attempt.

A chunk is one atomic commit (:mod:`onceflow.dedup.commit`), so what it carries is what one
Lua call carries and how long it holds Redis. The rule: a chunk is the longest run of the
next input rows that holds at most ``budget.records`` rows and ``budget.size`` bytes (each
row weighs what it was read from, see :class:`~onceflow.kernel.records.Record`), and at least
one row. A chunk is cut as soon as the rows waiting must be cut (a chunk's worth of rows, or
more bytes than a chunk may hold), never because an Arrow batch or a source slice ended, so
the same rows in the same order make the same chunks whatever batches brought them. (Bounded
runs, ``records == 0``, keep their chunks within a batch: :meth:`Chunker.flush` after each.)

What replays rest on is not this rule but IDs: a retried attempt learns which inputs earlier
attempts committed from its backup (fields ``i<n>``, position IDs included) and replays
them, whatever chunk they now fall in; chunk numbers only name backup fields, and a retry
numbers its chunks on from the first no attempt committed (``TaskBackup.next_chunk``). A
chunk whose outputs pass the budget is cut again after the function ran
(:meth:`~.loop.TaskRun.process_chunk`), which depends on what the function
returned; either cut is safe for the same reason.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator
from itertools import accumulate
from typing import NamedTuple

from onceflow.kernel.limits import Budget
from onceflow.kernel.records import InRow


class Part(NamedTuple):
    """Input rows with, per row: its source lane, positional ID or not, bytes, fingerprint.

    See :class:`~onceflow.kernel.records.Record`. ``lanes``, ``positional`` and ``fingerprints``
    are empty for rows another stage wrote (no lanes, no positional IDs, no fingerprints).
    """

    rows: list[InRow]
    lanes: list[str | None]
    positional: list[bool]
    sizes: list[int]
    fingerprints: list[int]


class Chunker:
    """Rows in, chunks out (see the module docstring for the rule)."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.rows: list[InRow] = []
        self.lanes: list[str | None] = []
        self.positional: list[bool] = []
        self.sizes: list[int] = []
        self.fingerprints: list[int] = []
        self.size = 0

    def add(self, part: Part) -> Iterator[Part]:
        """Take ``part``'s rows; yield every chunk they complete."""
        self.rows += part.rows
        self.lanes += part.lanes
        self.positional += part.positional
        self.sizes += part.sizes
        self.fingerprints += part.fingerprints
        self.size += sum(part.sizes)
        while self.rows and self._must_cut():
            yield self._cut()

    def flush(self) -> Iterator[Part]:
        """The rows still waiting, in chunks (the input ended, or a bounded run's batch)."""
        while self.rows:
            yield self._cut()

    def _must_cut(self) -> bool:
        """Whether the waiting rows hold a whole chunk: no row to come can join it."""
        records, size = self.budget
        return (0 < records <= len(self.rows)) or (0 < size < self.size)

    def _cut(self) -> Part:
        """The next chunk: the longest run of waiting rows within the budget (one at least)."""
        records, size = self.budget
        n = len(self.rows) if records <= 0 else min(len(self.rows), records)
        if size > 0 and self.size > size:
            n = max(1, bisect_right(list(accumulate(self.sizes[:n])), size))
        chunk = Part(
            self.rows[:n],
            self.lanes[:n],
            self.positional[:n],
            self.sizes[:n],
            self.fingerprints[:n],
        )
        self.rows, self.lanes = self.rows[n:], self.lanes[n:]
        self.positional, self.sizes = self.positional[n:], self.sizes[n:]
        self.fingerprints = self.fingerprints[n:]
        self.size -= sum(chunk.sizes)
        return chunk
