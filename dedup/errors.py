"""Errors of the receiving side."""

from __future__ import annotations

from onceflow.kernel.errors import ConfigError, OnceflowError


class FencedError(OnceflowError):
    """A newer driver or task attempt owns this work; this one must not commit."""


class DedupConfigError(ConfigError):
    """Dedup settings contradict each other or the pipeline's stored settings."""


class HorizonMovedError(OnceflowError):
    """A commit was refused: GC raised the dedup floor after the chunk was admitted.

    The task redoes the chunk, and records now below the floor become late dead letters.
    """
