"""Errors of the receiving side."""

from __future__ import annotations

from onceflow.kernel.errors import ConfigError, OnceflowError, ServiceError


class FencedError(OnceflowError):
    """A newer driver or task attempt owns this work; this one must not commit."""


class DedupConfigError(ConfigError):
    """Dedup settings contradict each other or the pipeline's stored settings."""


class ServerChangedError(ServiceError):
    """The Redis server restarted or failed over while a batch ran: the batch is not committed.

    The server may have lost writes it had not made durable; nothing is written on top of
    what is left, and the batch is run again (see :mod:`onceflow.dedup.durability`).
    """


class RedisBehindError(ServiceError):
    """Redis lost writes of a micro-batch Spark had committed: the result cannot be exact."""


def server_changed_message(where: str, batch: int) -> str:
    """What a task or the driver says when the Redis server changed during a batch."""
    return (
        f"the Redis server of {where} restarted or failed over during micro-batch {batch} "
        "(its run id changed): writes it had not made durable may be lost, so the batch is "
        "not committed and is run again from what Redis kept"
    )


class FiltersAheadError(ServiceError):
    """A worker's Bloom filters cover commits the same Redis instance no longer holds."""
