"""The chunking rule: by records and by bytes, the same chunks however the rows arrive."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from onceflow.kernel.limits import Budget
from onceflow.runtime.task.chunking import Chunker, Part


def _part(sizes: list[int], start: int = 0) -> Part:
    rows = [(0, bytes([i % 256]) * 16, i, None, i) for i in range(start, start + len(sizes))]
    n = len(sizes)
    return Part(rows, [f"t:{i % 2}" for i in range(n)], [False] * n, sizes, [0] * n)


def _chunks(budget: Budget, parts: list[list[int]], whole_batches: bool = False) -> list[list[int]]:
    """The sizes of each chunk the chunker cuts from ``parts`` (lists of row sizes)."""
    chunker = Chunker(budget)
    out: list[Part] = []
    start = 0
    for sizes in parts:
        out += chunker.add(_part(sizes, start))
        if whole_batches:
            out += chunker.flush()
        start += len(sizes)
    out += chunker.flush()
    for chunk in out:
        assert len(chunk.rows) == len(chunk.lanes) == len(chunk.positional) == len(chunk.sizes)
    assert [r[4] for c in out for r in c.rows] == list(range(start)), "every row once, in order"
    return [c.sizes for c in out]


def test_chunks_are_cut_by_count():
    assert _chunks(Budget(4, 0), [[1] * 10]) == [[1] * 4, [1] * 4, [1] * 2]


def test_chunks_are_cut_by_bytes():
    assert _chunks(Budget(0, 7), [[3] * 5]) == [[3, 3], [3, 3], [3]]


def test_a_chunk_is_cut_by_whichever_bound_comes_first():
    assert _chunks(Budget(3, 10), [[1, 1, 1, 1, 9, 9, 2]]) == [[1, 1, 1], [1, 9], [9], [2]]


def test_a_row_over_the_bytes_is_a_chunk_of_its_own():
    assert _chunks(Budget(100, 5), [[1, 20, 1, 1]]) == [[1], [20], [1, 1]]


def test_bounded_runs_cut_within_each_batch_by_bytes_only():
    assert _chunks(Budget(0, 5), [[2, 2, 2], [2]], whole_batches=True) == [[2, 2], [2], [2]]


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 50), max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=8),
    records=st.integers(0, 10),
    size=st.integers(0, 120),
)
def test_the_same_rows_make_the_same_chunks_however_they_arrive(sizes, cuts, records, size):
    """Arrow batches and source slices may end anywhere: chunks must not depend on it, and
    each holds at least one row and, unless it is one row, stays within the budget."""
    budget = Budget(records, size)
    bounds = sorted({min(c, len(sizes)) for c in cuts} | {0, len(sizes)})
    parts = [sizes[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    whole = _chunks(budget, [sizes])
    assert _chunks(budget, parts) == whole
    for chunk in whole:
        assert chunk and (len(chunk) == 1 or budget.fits(len(chunk), sum(chunk)))
