"""Asserting on a streaming run's keyed state: what ``onceflow state scan`` reads, as a dict."""

from __future__ import annotations

from typing import Any

from onceflow.kernel.settings import RedisSettings, new_redis_client
from onceflow.operations.state_read import read_state


def keyed_state(redis_url: str, namespace: str, step: str) -> dict[Any, Any]:
    """Every key's state of ``step``, as committed so far.

    A combine's is its accumulator; a ``process`` step's ``{"state": ..., "timers": ...,
    "expires": ...}`` (see :mod:`onceflow.operations.state_read`).

    >>> keyed_state(redis.url, "orders", "revenue")  # doctest: +SKIP
    {'c1': 15, 'c2': 7}
    """
    settings = RedisSettings(redis_url)
    client = new_redis_client(settings, namespace)
    try:
        entries = read_state(
            client, namespace, step, connect=lambda tag: new_redis_client(settings, tag)
        )
        return {entry.key: entry.state for entry in entries}
    finally:
        client.close()
