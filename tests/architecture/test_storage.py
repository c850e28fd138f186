"""Redis is reached one way: one retry policy (``kernel/settings.py``) for every client."""

from __future__ import annotations

import ast

from tests.architecture.layers import modules

POLICY = "onceflow.kernel.settings"


def _retry_importers(sources: dict[str, str]) -> list[str]:
    """Modules that import redis-py's retry or backoff: each would make a policy of its own."""
    found = []
    for name, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module in ("redis.retry", "redis.backoff"):
                found.append(name)
            elif isinstance(node, ast.Import) and any(
                a.name in ("redis.retry", "redis.backoff") for a in node.names
            ):
                found.append(name)
    return sorted(set(found) - {POLICY})


def test_one_retry_policy_for_every_redis_client():
    sources = {name: path.read_text(encoding="utf-8") for name, path in modules().items()}
    assert _retry_importers(sources) == []


def test_a_second_retry_policy_is_caught():
    made = "from redis.backoff import ExponentialBackoff\nfrom redis.retry import Retry\n"
    assert _retry_importers({"onceflow.operations.ui": made}) == ["onceflow.operations.ui"]
