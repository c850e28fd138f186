"""Golden and must-not-fuse cases for each optimizer rule, applied on its own."""

from __future__ import annotations

import pytest

from onceflow.graph_optimizer.ir import Combine, Phase
from onceflow.graph_optimizer.optimizer import RULES, optimize
from onceflow.graph_optimizer.plan import initial_plan
from onceflow.graph_optimizer.rules import (
    fuse_producer_consumer,
    fuse_siblings,
    lift_combiners,
    remove_dead_branches,
)
from tests.graph_optimizer import helpers as h
from tests.graph_optimizer.helpers import stages


def _initial(pipeline):
    return initial_plan(pipeline.graph)


# -- remove_dead_branches --------------------------------------------------------------------


def test_dead_branches_are_removed_and_listed():
    plan = remove_dead_branches(_initial(h.dead_branch()))
    assert plan.removed == ("dead1", "dead2")
    assert [n.name for n in plan.graph] == ["src", "live", "out"]
    assert stages(plan) == [("src",), ("live",), ("out",)]


def test_live_graph_is_returned_unchanged_by_identity():
    plan = _initial(h.chain())
    assert remove_dead_branches(plan) is plan


# -- lift_combiners ---------------------------------------------------------------------------


def test_full_combine_is_split_around_its_exchange():
    plan = lift_combiners(_initial(h.keyed_sum()))
    g = plan.graph
    partial, final = g["agg/partial"], g["agg"]
    assert isinstance(partial, Combine) and partial.phase is Phase.PARTIAL
    assert partial.inputs == ("k",)
    assert g["agg/exchange"].inputs == ("agg/partial",)
    assert isinstance(final, Combine) and final.phase is Phase.FINAL
    assert stages(plan) == [("src",), ("k",), ("agg/partial",), ("agg",), ("out",)]


def test_unliftable_combiner_is_left_alone():
    plan = _initial(h.group_lists())
    assert lift_combiners(plan) is plan


def test_lifting_twice_changes_nothing():
    once = lift_combiners(_initial(h.keyed_sum()))
    assert lift_combiners(once) is once


# -- fuse_producer_consumer -------------------------------------------------------------------


def test_element_wise_chain_becomes_one_stage():
    assert stages(fuse_producer_consumer(_initial(h.chain()))) == [("src", "a", "b", "out")]


def test_never_fuses_across_an_exchange():
    plan = fuse_producer_consumer(_initial(h.keyed_sum()))
    assert stages(plan) == [("src", "k"), ("agg", "out")]


def test_consumers_of_a_combine_fuse_into_its_stage():
    plan = fuse_producer_consumer(lift_combiners(_initial(h.chain_after_combine())))
    assert stages(plan) == [("src", "k", "agg/partial"), ("agg", "fmt", "out")]


def test_fan_out_consumers_join_their_producer():
    plan = fuse_producer_consumer(_initial(h.fan_out()))
    assert stages(plan) == [("src", "a", "out-a", "b", "out-b")]


def test_merge_of_branches_from_one_stage_fuses():
    plan = fuse_producer_consumer(_initial(h.merge_same_stage()))
    assert stages(plan) == [("src", "a", "b", "m", "out")]


def test_merge_of_two_sources_does_not_fuse_with_either():
    plan = fuse_producer_consumer(_initial(h.merge_two_sources()))
    assert stages(plan) == [("s1",), ("s2",), ("m", "after", "out")]


def test_fusion_is_identity_on_a_fused_plan():
    plan = fuse_producer_consumer(_initial(h.chain()))
    assert fuse_producer_consumer(plan) is plan


# -- fuse_siblings ----------------------------------------------------------------------------


def test_direct_siblings_share_one_stage():
    plan = fuse_siblings(_initial(h.fan_out()))
    assert stages(plan) == [("src",), ("a", "b"), ("out-a", "out-b")]


def test_exchange_siblings_share_one_shuffle_and_stage():
    plan = optimize(h.two_combines().graph)
    assert stages(plan) == [
        ("src", "k", "sum/partial", "count/partial"),
        ("sum", "out-sum", "count", "out-count"),
    ]


def test_a_stage_and_its_own_consumer_are_not_siblings():
    plan = fuse_siblings(_initial(h.chain()))
    assert stages(plan) == [("src",), ("a",), ("b",), ("out",)]


def test_mixed_direct_and_exchange_readers_stay_apart():
    from onceflow.pipeline import Pipeline, sinks, sources

    p = Pipeline("mixed")
    keyed = p.read("src", sources.Collection(range(5))).key_by("k", str)
    keyed.combine_per_key("agg", "count").write("o1", sinks.Collect())
    keyed.map("m", str).write("o2", sinks.Collect())
    plan = fuse_siblings(_initial(p))
    assert ("agg",) in stages(plan) and ("m",) in stages(plan)


# -- the driver -------------------------------------------------------------------------------


def test_no_rules_gives_one_stage_per_node():
    plan = optimize(h.keyed_sum().graph, rules=())
    assert stages(plan) == [("src",), ("k",), ("agg",), ("out",)]


def test_all_rules_reach_a_fixed_point():
    plan = optimize(h.keyed_sum().graph)
    assert stages(plan) == [("src", "k", "agg/partial"), ("agg", "out")]
    again = optimize(plan.graph)
    assert stages(again) == stages(plan)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__name__)
def test_each_rule_documents_what_must_run_before_it_and_what_skipping_costs(rule):
    doc = (rule.__module__ and __import__(rule.__module__, fromlist=["x"]).__doc__) or ""
    assert "skipping it costs" in doc.lower()


def test_boundaries_are_exposed_for_the_runtime():
    plan = optimize(h.keyed_sum().graph)
    kinds = [(b.kind.value, b.name, b.sender, b.receiver) for b in plan.boundaries()]
    assert kinds == [
        ("source", "src", None, "src"),
        ("exchange", "agg/exchange", "src", "agg"),
        ("sink", "out", "agg", "out"),
    ]
