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
