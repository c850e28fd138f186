"""The root of every error Onceflow raises on purpose.

Each package adds one-line subclasses in its own ``errors.py``; a message always says what
was expected, what was found and how to fix it.
"""

from __future__ import annotations


class OnceflowError(Exception):
    """Base class: catch this to catch anything Onceflow raises deliberately."""


class ConfigError(OnceflowError):
    """A setting is missing, malformed or contradicts another one."""


class CodecError(OnceflowError):
    """A value cannot be encoded or decoded."""


class ServiceError(OnceflowError):
    """A required service (Redis, Kafka, Spark) is unreachable or misconfigured."""


class ServerChangedError(ServiceError):
    """The Redis server restarted or failed over while a batch ran: the batch is not committed.

    The server may have lost writes it had not made durable; nothing is written on top of
    what is left, and the batch is run again (see :mod:`onceflow.dedup.durability`). Raised
    by the fenced scripts (the server's run id changed) and by the storage layer when the
    server no longer knows a script loaded a moment before (``NoScriptError``: a new server).
    """


def server_changed_message(where: str, batch: int) -> str:
    """What a task or the driver says when the Redis server changed during a batch."""
    return (
        f"the Redis server of {where} restarted or failed over during micro-batch {batch} "
        "(its run id changed): writes it had not made durable may be lost, so the batch is "
        "not committed and is run again from what Redis kept"
    )
