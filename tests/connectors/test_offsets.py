"""Offset arithmetic of the Kafka source: canonical offsets and fair caps (no broker needed)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from onceflow.connectors.kafka.offsets import canonical, cap_offsets, split_tp, tp_key

LAGS = st.dictionaries(
    st.builds(tp_key, st.sampled_from(["a", "b.c", "t:x"]), st.integers(0, 40)),
    st.integers(0, 10_000),
    min_size=1,
    max_size=30,
)


@given(LAGS)
def test_canonical_offsets_serialize_the_same_whatever_the_key_order(offsets):
    shuffled = dict(reversed(list(offsets.items())))
    assert json.dumps(canonical(offsets)) == json.dumps(canonical(shuffled))
    assert [split_tp(k) for k in canonical(offsets)] == sorted(split_tp(k) for k in offsets)


@given(LAGS, st.integers(1, 5_000))
def test_a_cap_reads_no_more_than_the_budget_and_leaves_no_backlog_out(lags, budget):
    start = {k: 100 for k in lags}
    end = {k: 100 + n for k, n in lags.items()}
    capped = cap_offsets(start, end, budget)
    taken = {k: capped[k] - start[k] for k in lags}
    assert all(0 <= taken[k] <= lags[k] for k in lags)
    assert sum(taken.values()) == min(budget, sum(lags.values()))
    behind = [k for k in lags if lags[k] > 0]
    if len(behind) <= budget:
        assert all(taken[k] >= 1 for k in behind), "a partition with a backlog was left out"
