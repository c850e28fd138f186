"""Errors a user sees while declaring a pipeline."""

from __future__ import annotations

from onceflow.kernel.errors import OnceflowError


class PipelineError(OnceflowError):
    """The pipeline declaration is wrong; the message says how to fix it."""
