"""Errors found while validating, optimizing or compiling a pipeline graph."""

from __future__ import annotations

from onceflow.kernel.errors import OnceflowError


class GraphError(OnceflowError):
    """The pipeline graph is not valid; the message says which stage and what to change."""


class DuplicateStageError(GraphError):
    """Two stages share one name."""


class UnknownInputError(GraphError):
    """A stage reads from a stage that does not exist."""


class CycleError(GraphError):
    """The stages form a cycle."""


class NotKeyedError(GraphError):
    """A keyed operation (exchange, combine) reads an unkeyed stream."""


class NoSinkError(GraphError):
    """Nothing is written anywhere."""


class CompileError(OnceflowError):
    """A plan cannot be compiled to Spark."""
