"""``combine_per_key(..., on_expiry=...)``: what the pipeline accepts and what the plan says."""

from __future__ import annotations

import pytest

from onceflow import Pipeline
from onceflow.connectors.collect import Collect
from onceflow.graph_optimizer.fingerprint import fingerprint, layout
from onceflow.pipeline.errors import PipelineError
from onceflow.sources import Collection


def _pipeline(**combine):
    p = Pipeline("expiry")
    (
        p.read("in", Collection([("a", 1)]))
        .key_by("k", lambda e: e[0])
        .map_values("v", lambda e: e[1])
        .combine_per_key("sum", "sum", **combine)
        .write("out", Collect())
    )
    return p


def test_on_expiry_is_checked():
    with pytest.raises(PipelineError, match="on_expiry must be 'forget' or 'delete'"):
        _pipeline(ttl="1d", on_expiry="drop")
    with pytest.raises(PipelineError, match="on_expiry='delete' needs a ttl"):
        _pipeline(on_expiry="delete")


def test_expiry_deletes_reach_the_plan_and_change_its_fingerprint():
    deletes = _pipeline(ttl="1d", on_expiry="delete")
    forgets = _pipeline(ttl="1d")
    ops = [op for stage in deletes.job().stages for op in stage.ops if op.name == "sum"]
    assert ops and all(op.expiry_deletes for op in ops)
    assert not any(op.expiry_deletes for s in forgets.job().stages for op in s.ops)
    a, b = (fingerprint(layout(p.plan())) for p in (deletes, forgets))
    assert a != b, "their expiries are stored apart: a change between them is a plan change"
