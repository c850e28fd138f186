"""Errors a user sees while declaring or running a pipeline."""

from __future__ import annotations

from onceflow.errors import ConfigError, OnceflowError


class PipelineError(OnceflowError):
    """The pipeline declaration is wrong; the message says how to fix it."""


class PipelineFileError(PipelineError):
    """A pipeline file cannot be loaded or exposes no pipeline."""


class RunError(OnceflowError):
    """A run failed; the message says what to check."""


__all__ = ["ConfigError", "PipelineError", "PipelineFileError", "RunError"]
