"""Test configuration: fixtures for real services live in plugin modules."""

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
]
