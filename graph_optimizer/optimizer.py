"""The optimizer driver: a tuple of rules and a short loop."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from onceflow.graph_optimizer.ir import Graph, validate
from onceflow.graph_optimizer.plan import Plan, initial_plan
from onceflow.graph_optimizer.rules import (
    fuse_producer_consumer,
    fuse_siblings,
    lift_combiners,
    remove_dead_branches,
)

Rule = Callable[[Plan], Plan]

RULES: tuple[Rule, ...] = (
    remove_dead_branches,
    lift_combiners,
    fuse_producer_consumer,
    fuse_siblings,
)

RULE_NAMES: dict[str, Rule] = {r.__name__: r for r in RULES}


def optimize(graph: Graph, rules: Sequence[Rule] = RULES) -> Plan:
    """Validate ``graph`` and apply ``rules`` until none changes the plan.

    ``rules=()`` gives the unoptimized plan: every node in a stage of its own.
    """
    plan = initial_plan(validate(graph))
    for _ in range(100):
        before = plan
        for rule in rules:
            plan = rule(plan)
        if plan is before:
            return plan
    msg = "optimizer did not converge after 100 rounds; this is a bug in a rule"
    raise RuntimeError(msg)


def rules_by_name(names: Sequence[str]) -> tuple[Rule, ...]:
    """Rules selected by name, in the driver's order; unknown names raise ``KeyError``."""
    unknown = [n for n in names if n not in RULE_NAMES]
    if unknown:
        known = ", ".join(RULE_NAMES)
        msg = f"unknown optimizer rule(s) {', '.join(unknown)}; known rules: {known}"
        raise KeyError(msg)
    return tuple(r for r in RULES if r.__name__ in names)
