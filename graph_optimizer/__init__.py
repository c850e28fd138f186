"""From a logical graph to a physical plan of fused stages, and from that plan to PySpark."""

from __future__ import annotations

from onceflow.graph_optimizer.ir import Graph, validate
from onceflow.graph_optimizer.optimizer import RULES, optimize
from onceflow.graph_optimizer.plan import Plan
from onceflow.runtime.combine_fn import CombineFn

__all__ = ["RULES", "CombineFn", "Graph", "Plan", "optimize", "validate"]
