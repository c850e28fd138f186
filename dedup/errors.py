"""Errors of the receiving side."""

from __future__ import annotations

from onceflow.kernel.errors import (
    ConfigError,
    OnceflowError,
    ServerChangedError,
    ServiceError,
    server_changed_message,
)

__all__ = [
    "DedupConfigError",
    "FencedError",
    "FiltersAheadError",
    "RedisBehindError",
    "ServerChangedError",
    "server_changed_message",
]


class FencedError(OnceflowError):
    """A newer driver or task attempt owns this work; this one must not commit."""


class DedupConfigError(ConfigError):
    """Dedup settings contradict each other or the pipeline's stored settings."""


class RedisBehindError(ServiceError):
    """Redis lost writes of a micro-batch Spark had committed: the result cannot be exact."""


class FiltersAheadError(ServiceError):
    """A worker's Bloom filters cover commits the same Redis instance no longer holds."""
