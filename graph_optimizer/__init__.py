"""From a logical graph to a physical plan of fused stages, and from that plan to PySpark."""

from __future__ import annotations

from graph_optimizer.combine_fn import CombineFn
from graph_optimizer.ir import Graph, validate
from graph_optimizer.optimizer import RULES, optimize
from graph_optimizer.plan import Plan

__all__ = ["RULES", "CombineFn", "Graph", "Plan", "optimize", "validate"]
