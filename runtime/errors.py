"""Errors of running a pipeline."""

from __future__ import annotations

from onceflow.kernel.errors import ConfigError, OnceflowError


class RuntimeFailure(OnceflowError):
    """A stage cannot go on (user code failed with ``on_error="fail"``, or a bug)."""


class StopStage(RuntimeFailure):
    """Not one record's fault (two sides of a join keyed unalike ...): the run stops with it.

    Raised from code a stage runs per record, it is never a dead letter: every record would
    become one. The message is the one line the user sees.
    """


class RunError(OnceflowError):
    """A run failed; the message says what to check."""


class PlanChangedError(ConfigError):
    """The pipeline's physical plan differs from the one its stored state was built with."""


class LostDeliveryError(RunError):
    """A sink committed a delivery Redis lost the record of, and this run cannot match it."""


TASK_FAILURE_MARK = "Onceflow task failure:"


class TaskFailure(RuntimeFailure):
    """A task failed; the message is one line starting with :data:`TASK_FAILURE_MARK`.

    The driver finds that line in Spark's failure text and shows it instead of the stack
    traces (which go to the log file).
    """
