"""Connection settings for Redis, with passwords and TLS passed straight through.

:class:`RedisSettings` reads the environment when a value is not given: ``REDIS_URL``
(``rediss://`` for TLS), ``REDIS_PASSWORD``, ``REDIS_SSL_CA_CERTS``, ``REDIS_SSL_CERTFILE``,
``REDIS_SSL_KEYFILE``. Anything else a client accepts goes in ``options``. Settings pickle to
the workers; secrets are never printed (``repr`` masks them). Kafka's settings are
:class:`onceflow.connectors.kafka.connection.KafkaSettings`, built on the same helpers.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

from onceflow.kernel.errors import ConfigError, ServiceError

_SECRET_WORDS = ("password", "secret", "token", "key")


def from_environment(env: dict[str, str], options: dict[str, Any]) -> dict[str, Any]:
    """Client options from environment variables (``option -> VARIABLE``), then ``options``."""
    merged: dict[str, Any] = {k: os.environ[v] for k, v in env.items() if os.environ.get(v)}
    merged.update(options)
    return merged


def mask_secrets(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with every value whose name says secret (password, token, key) as ``***``."""
    return {k: ("***" if any(w in k for w in _SECRET_WORDS) else v) for k, v in options.items()}


@dataclass(frozen=True)
class RedisSettings:
    """Where Redis is and how to log in; ``options`` go to ``redis.Redis.from_url``."""

    url: str
    options: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def cluster(self) -> bool:
        """Whether the URL names a Redis Cluster (``redis+cluster://``)."""
        return self.url.startswith(("redis+cluster://", "rediss+cluster://"))

    @classmethod
    def from_env(cls, url: str | None = None, **options: Any) -> RedisSettings:
        """Settings from arguments, falling back to the environment."""
        url = url or os.environ.get("REDIS_URL")
        if not url:
            msg = "no Redis configured: pass --redis-url or set REDIS_URL (redis://host:6379/0)"
            raise ConfigError(msg)
        env = {
            "password": "REDIS_PASSWORD",
            "ssl_ca_certs": "REDIS_SSL_CA_CERTS",
            "ssl_certfile": "REDIS_SSL_CERTFILE",
            "ssl_keyfile": "REDIS_SSL_KEYFILE",
        }
        merged = from_environment(env, options)
        schemes = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")
        if not url.startswith(schemes):
            msg = (
                "REDIS_URL must start with redis://, rediss:// or unix:// (or, for a Redis "
                f"Cluster, redis+cluster:// or rediss+cluster://), got {url.split('@')[-1]!r}"
            )
            raise ConfigError(msg)
        return cls(url, merged)

    def __repr__(self) -> str:
        return f"RedisSettings({self.url.split('@')[-1]!r}, {mask_secrets(self.options)})"


# The retry policy of every Redis client Onceflow makes (retry_options): exponential backoff
# from RETRY_BASE_S, capped. A run rides out ~40 s (a restart from the AOF, a failover);
# operator commands and the live page fail fast with fewer retries and a shorter cap.
RETRY_BASE_S = 0.05
RUN_RETRIES = 25
RUN_RETRY_CAP_S = 2.0


def retry_options(retries: int = RUN_RETRIES, cap_s: float = RUN_RETRY_CAP_S) -> dict[str, Any]:
    """Onceflow's one Redis retry policy, as redis-py client options.

    Connection errors, timeouts and a server still loading its data set are retried with
    exponential backoff (from :data:`RETRY_BASE_S`, at most ``cap_s`` between tries). Every
    Onceflow script is safe to run twice, which is what makes a retried call safe.
    """
    import redis
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    return {
        "retry": Retry(ExponentialBackoff(cap=cap_s, base=RETRY_BASE_S), retries=retries),
        "retry_on_error": [
            redis.exceptions.ConnectionError,
            redis.exceptions.TimeoutError,
            redis.exceptions.BusyLoadingError,
        ],
    }


_clients: dict[tuple[str, str | None, tuple[tuple[str, str], ...]], Any] = {}
_clients_lock = threading.Lock()


def redis_client(settings: RedisSettings, namespace: str | None = None) -> Any:
    """A shared client per settings (and namespace, on a cluster) and process.

    Connection errors are retried with backoff for ~40 s (:func:`retry_options`), so a Redis
    restart from its AOF, or a cluster failover, is ridden out; every Onceflow script is safe
    to run twice for this reason. On a Redis Cluster (``redis+cluster://``) a namespace's
    client talks to the master serving the namespace's slot (:mod:`onceflow.kernel.slots`);
    without a namespace it is redis-py's cluster client, for what spans namespaces (finding
    every pipeline).
    """
    key = (
        settings.url,
        namespace if settings.cluster else None,
        tuple(sorted((k, repr(v)) for k, v in settings.options.items())),
    )
    client = _clients.get(key)
    if client is not None:
        return client
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = new_redis_client(
                settings,
                namespace,
                **retry_options(),
                socket_timeout=30,
                socket_connect_timeout=5,
                health_check_interval=15,
            )
            _clients[key] = client
    return client


def new_redis_client(
    settings: RedisSettings, namespace: str | None = None, **client_options: Any
) -> Any:
    """A new client with ``client_options`` (retries, timeouts) beside the settings' own.

    On a Redis Cluster it talks to the master serving ``namespace``'s slot; without a
    namespace it is redis-py's cluster client (see :mod:`onceflow.kernel.slots`).
    """
    import redis

    from onceflow.kernel.slots import namespace_client

    if settings.cluster:
        return namespace_client(settings.url, settings.options, namespace, client_options)
    return redis.Redis.from_url(settings.url, **client_options, **settings.options)


# Eviction policies that may delete keys without a TTL: Onceflow's state has none, so only
# these can evict it (volatile-* policies and noeviction leave it alone).
EVICTING_POLICIES = frozenset({"allkeys-lru", "allkeys-lfu", "allkeys-random"})


def _config(client: Any, name: str) -> str | None:
    try:
        value = client.config_get(name).get(name)
    except Exception:  # noqa: BLE001 - managed Redis often forbids CONFIG
        return None
    return str(value) if value is not None else None


def check_durable(client: Any, allow_non_durable: bool) -> str:
    """Refuse a Redis that could lose or evict committed state; return what was found.

    Refused: persistence off (``appendonly no``), an AOF never fsynced (``appendfsync no``),
    and an eviction policy that may delete keys without a TTL. Where ``CONFIG`` is
    forbidden (managed services), ``INFO persistence`` says whether AOF is on.
    """
    aof = _config(client, "appendonly")
    fsync = _config(client, "appendfsync")
    policy = _config(client, "maxmemory-policy")
    if aof is None:
        info = client.info("persistence")
        aof = "yes" if info.get("aof_enabled") else "no"
    found = f"appendonly={aof}, appendfsync={fsync or '?'}, maxmemory-policy={policy or '?'}"
    problems = []
    if aof != "yes":
        problems.append("persistence is off (appendonly no): state is lost when Redis restarts")
    if fsync == "no":
        problems.append(
            "appendfsync no: the OS decides when the AOF reaches disk, so a machine crash "
            "loses an unknown amount of committed state (use everysec or always)"
        )
    if policy in EVICTING_POLICIES:
        problems.append(
            f"maxmemory-policy {policy} may evict Onceflow's keys (seen IDs, state) when "
            "memory runs out, silently (use noeviction)"
        )
    if problems and not allow_non_durable:
        msg = (
            f"Redis is not durable enough for exactly-once ({found}): "
            + "; ".join(problems)
            + ". Fix the Redis configuration or, knowingly, pass --allow-non-durable-redis"
        )
        raise ServiceError(msg)
    return found
