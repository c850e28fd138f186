"""Errors of running a pipeline."""

from __future__ import annotations

from onceflow.kernel.errors import ConfigError, OnceflowError


class RuntimeFailure(OnceflowError):
    """A stage cannot go on (user code failed with ``on_error="fail"``, or a bug)."""


class RunError(OnceflowError):
    """A run failed; the message says what to check."""


class PlanChangedError(ConfigError):
    """The pipeline's physical plan differs from the one its stored state was built with."""
