"""Errors of the receiving side."""

from __future__ import annotations

from onceflow.kernel.errors import ConfigError, OnceflowError, ServiceError


class FencedError(OnceflowError):
    """A newer driver or task attempt owns this work; this one must not commit."""


class DedupConfigError(ConfigError):
    """Dedup settings contradict each other or the pipeline's stored settings."""


class FiltersAheadError(ServiceError):
    """A worker's Bloom filters cover commits the same Redis instance no longer holds."""
