"""Byte budgets: the settings, how outputs are split, and dead letters that stay small."""

from __future__ import annotations

import base64

import pytest

from onceflow import DedupConfig, Pipeline
from onceflow.dedup.errors import DedupConfigError
from onceflow.kernel.limits import MAX_CHUNK_BYTES, Budget, split_outputs
from onceflow.kernel.records import DeadLetter, Output
from onceflow.pipeline.errors import PipelineError


def test_outputs_are_split_in_order_within_a_budget():
    outs = [Output(0, bytes(16), 0, None, b"x" * n) for n in (10, 10, 100, 10)]
    parts = list(split_outputs(outs, Budget(0, 100)))
    assert [[len(o.value) for o in p] for p in parts] == [[10, 10], [100], [10]]
    assert list(split_outputs(outs, Budget(3, 0))) == [outs[:3], outs[3:]]
    assert list(split_outputs(outs, Budget(0, 0))) == [outs]


def test_a_budget_is_full_at_either_bound():
    assert Budget(3, 100).full(3, 0) and Budget(3, 100).full(1, 100)
    assert not Budget(3, 100).full(2, 99) and not Budget(0, 0).full(10**6, 10**9)


@pytest.mark.parametrize(
    "settings",
    [{"chunk_bytes": 1000}, {"chunk_bytes": MAX_CHUNK_BYTES + 1}, {"delivery_bytes": 10}],
    ids=["chunk-too-small", "chunk-past-redis", "delivery-too-small"],
)
def test_byte_budgets_out_of_range_are_refused(settings):
    with pytest.raises(DedupConfigError, match=next(iter(settings))):
        DedupConfig(**settings)


def test_a_record_limit_above_what_one_commit_carries_is_refused():
    with pytest.raises(PipelineError, match="chunk_bytes .* is below max_record_bytes"):
        Pipeline("p", max_record_bytes=8 << 20, dedup=DedupConfig(chunk_bytes=4 << 20))


def test_a_dead_letter_carries_at_most_the_limit_of_its_payload():
    letter = DeadLetter(b"i" * 16, 0, "s", "too big", "t:0@1", raw=b"r" * 5000, value="v" * 5000)
    small = letter.to_element(payload_limit=100)
    assert len(base64.b64decode(small["raw_b64"])) == 100 and small["raw_bytes"] == 5000
    assert len(small["value"]) == 100 and small["value_chars"] == 5000
    whole = letter.to_element()
    assert len(base64.b64decode(whole["raw_b64"])) == 5000 and "raw_bytes" not in whole
