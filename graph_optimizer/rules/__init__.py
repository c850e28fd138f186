"""Optimizer rules: each module exports one function of its own name, ``Plan -> Plan``.

A rule returns the very same plan object when it changes nothing, so the driver can stop on
``is``. Each rule's module docstring shows the rule on a small pipeline, the plan's stages
before and after, as a doctest (run by ``tests/graph_optimizer/test_rule_examples.py``).
"""

from __future__ import annotations

from onceflow.graph_optimizer.rules.fuse_producer_consumer import fuse_producer_consumer
from onceflow.graph_optimizer.rules.fuse_siblings import fuse_siblings
from onceflow.graph_optimizer.rules.lift_combiners import lift_combiners
from onceflow.graph_optimizer.rules.remove_dead_branches import remove_dead_branches

__all__ = ["fuse_producer_consumer", "fuse_siblings", "lift_combiners", "remove_dead_branches"]
