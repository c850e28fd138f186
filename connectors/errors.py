"""Errors raised by sources and sinks."""

from __future__ import annotations

from onceflow.kernel.errors import OnceflowError


class ConnectorError(OnceflowError):
    """A source or sink is misconfigured or its system refused it."""
