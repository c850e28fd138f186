"""Each optimizer rule's module docstring carries a before/after example that runs.

The examples are doctests (the model: sqlglot's ``optimizer/eliminate_ctes.py``), so a rule
whose behaviour changes fails here until its docstring says what it now does.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

from onceflow.graph_optimizer import rules
from onceflow.graph_optimizer.optimizer import RULES

RULE_MODULES = sorted(m.name for m in pkgutil.iter_modules(rules.__path__))


def test_every_rule_of_the_driver_has_a_module():
    assert sorted(r.__name__ for r in RULES) == RULE_MODULES


@pytest.mark.parametrize("name", RULE_MODULES)
def test_the_rules_example_runs_as_written(name):
    module = importlib.import_module(f"{rules.__name__}.{name}")
    finder = doctest.DocTestFinder(exclude_empty=True)
    examples = [t for t in finder.find(module) if t.name == module.__name__ and t.examples]
    assert examples, f"{module.__name__} has no example: add a doctest to its module docstring"
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, report=True)
    assert result.failed == 0, f"{module.__name__}: {result.failed} example(s) failed"
