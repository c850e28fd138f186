"""Test configuration: fixtures for real services live in plugin modules.

Tests marked ``long`` run only with ``--long`` (or ``ONCEFLOW_LONG_TESTS=1``): variants that
repeat what a shorter test in the default suite already proves, at several minutes each
(``./quickstart.sh test --long``).
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Spark's Python workers import functions defined in test modules by reference: let them
# find the tests package.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

pytest_plugins = [
    "tests.fixtures.spark",
    "tests.fixtures.redis",
    "tests.fixtures.kafka",
    "tests.fixtures.spark_cluster",
    "tests.fixtures.postgres",
    "tests.fixtures.registry",
]


def pytest_addoption(parser):  # type: ignore[no-untyped-def]
    parser.addoption("--long", action="store_true", help="also run the tests marked long")


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    import pytest

    if config.getoption("--long") or os.environ.get("ONCEFLOW_LONG_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="long variant: run with --long (or ONCEFLOW_LONG_TESTS=1)")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)
