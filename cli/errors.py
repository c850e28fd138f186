"""Errors of the command line."""

from __future__ import annotations

from onceflow.kernel.errors import ConfigError, OnceflowError


class PipelineFileError(OnceflowError):
    """A pipeline file cannot be loaded or exposes no pipeline."""


class ConfigFileError(ConfigError):
    """A config file or an environment variable holds a key or value no option accepts."""
