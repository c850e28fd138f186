"""Errors of the command line."""

from __future__ import annotations

from onceflow.kernel.errors import OnceflowError


class PipelineFileError(OnceflowError):
    """A pipeline file cannot be loaded or exposes no pipeline."""
