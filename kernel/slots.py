"""Redis Cluster: each hash tag's keys live in one slot, reached on the master serving it.

Every key of a namespace carries the hash tag ``{<namespace>}``, or ``{<namespace>:<scope>}``
for a partition scope (see :mod:`onceflow.kernel.keyspace`), so the Lua scripts that commit a
chunk's seen-marks, backup and state in one step touch one slot. A URL
``redis+cluster://host:port`` (or ``rediss+cluster://`` for TLS) says the server is a Redis
Cluster: redis-py's cluster client finds the master that serves a tag's slot, and the tag's
client is a plain client whose connections go to that master. Name several seed nodes,
comma-separated (``redis+cluster://:pw@10.0.0.1:6379,10.0.0.2:6379``), so that a run can
start while one of them is down. Every new connection asks again, so after a failover (the
master dies, its replica takes over) the client's retries reconnect to the
new master; a reply that says the slot moved (``MOVED``, ``ASK``, ``CLUSTERDOWN``,
``TRYAGAIN``, or ``READONLY`` from a demoted master) drops the connection and is retried
the same way. Commands and scripts are never split across nodes.

What a failover may lose, and how a run makes that a clear stop rather than a silent loss,
is in :mod:`onceflow.dedup.durability`.

Different namespaces hash to different slots, so several pipelines spread over the masters;
within a pipeline, each partition of a keyed stage has a hash tag of its own (a partition
scope, :mod:`onceflow.kernel.scopes`) and a client like a namespace's.
"""

from __future__ import annotations

import threading
from typing import Any

from onceflow.kernel.errors import ServiceError

CLUSTER_SCHEMES = {"redis+cluster://": "redis://", "rediss+cluster://": "rediss://"}
# Replies of a node that no longer serves the slot (or not yet): reconnect and ask again.
_MOVED_PREFIXES = ("MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN")


def is_cluster_url(url: str) -> bool:
    """Whether the URL names a Redis Cluster (``redis+cluster://`` or ``rediss+cluster://``)."""
    return url.startswith(tuple(CLUSTER_SCHEMES))


def node_url(url: str) -> str:
    """The URL of the cluster's first seed node as a plain ``redis://`` (or ``rediss://``) URL."""
    return seed_urls(url)[0]


def seed_urls(url: str) -> list[str]:
    """One plain URL per seed node of ``redis+cluster://[auth@]host:port[,host:port...][/db]``."""
    scheme = next((s for s in CLUSTER_SCHEMES if url.startswith(s)), None)
    if scheme is None:
        return [url]
    plain, rest = CLUSTER_SCHEMES[scheme], url[len(scheme) :]
    auth, at, hosts = rest.rpartition("@")
    hosts, slash, tail = hosts.partition("/")
    prefix = plain + (auth + at if at else "")
    return [prefix + host + slash + tail for host in hosts.split(",") if host]


def namespace_slot(namespace: str) -> int:
    """The hash slot of every key of a namespace (its hash tag is the namespace)."""
    from redis.crc import key_slot

    return int(key_slot(namespace.encode()))


class SlotLocator:
    """Finds the master that serves a slot, through redis-py's cluster client.

    The cluster client is made on first use and refreshed each time it is asked: a
    connection is only made after the previous one failed, when the topology may have
    changed (a failover).
    """

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        self._seeds = seed_urls(url)
        self._options = options
        self._cluster: Any = None
        self._lock = threading.Lock()

    def cluster(self) -> Any:
        """redis-py's cluster client (for topology and cross-namespace scans)."""
        with self._lock:
            if self._cluster is None:
                self._cluster = self._connect()
            return self._cluster

    def _connect(self) -> Any:
        """The cluster client, from the first seed node that answers."""
        from redis.cluster import RedisCluster

        failures = []
        for seed in self._seeds:
            try:
                return RedisCluster.from_url(
                    seed, socket_connect_timeout=5, socket_timeout=30, **self._options
                )
            except Exception as exc:  # noqa: BLE001 - try the next seed, then say all
                failures.append(f"{seed.split('@')[-1]}: {type(exc).__name__}: {exc}")
        msg = "cannot reach the Redis Cluster through any seed node (" + "; ".join(failures) + ")"
        raise ServiceError(msg)

    def master_of(self, slot: int) -> tuple[str, int]:
        """``(host, port)`` of the master serving ``slot`` now."""
        cluster = self.cluster()
        with self._lock:
            manager = cluster.nodes_manager
            try:
                manager.initialize()
            except Exception as exc:  # noqa: BLE001 - every known node down: a connection error
                import redis

                msg = f"no Redis Cluster node answers: {exc}"
                raise redis.exceptions.ConnectionError(msg) from exc
            node = manager.get_node_from_slot(slot)
        if node is None:
            import redis

            msg = f"no master serves slot {slot} yet"
            raise redis.exceptions.ConnectionError(msg)
        return str(node.host), int(node.port)


_locators: dict[tuple[str, tuple[tuple[str, str], ...]], SlotLocator] = {}
_locators_lock = threading.Lock()


def locator_for(url: str, options: dict[str, Any]) -> SlotLocator:
    """One locator per cluster URL and options, per process."""
    key = (url, tuple(sorted((k, repr(v)) for k, v in options.items())))
    with _locators_lock:
        found = _locators.get(key)
        if found is None:
            found = _locators[key] = SlotLocator(url, options)
        return found


def _moved_errors() -> tuple[type[Exception], ...]:
    """redis-py's exceptions for replies saying another node serves the slot (or none yet)."""
    import redis

    e = redis.exceptions
    return (e.AskError, e.TryAgainError, e.ClusterDownError)  # MovedError is an AskError


def slot_connection_class(base: type, locator: SlotLocator, slot: int) -> type:
    """A connection class that connects to whichever master serves ``slot`` at connect time."""
    import redis

    class SlotOwnerConnection(base):  # type: ignore[misc]
        def connect_check_health(self, *args: Any, **kwargs: Any) -> Any:
            if not self._sock:
                self.host, self.port = locator.master_of(slot)
            return super().connect_check_health(*args, **kwargs)

        def read_response(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().read_response(*args, **kwargs)
            except redis.exceptions.ReadOnlyError as exc:  # a master demoted to replica
                self.disconnect()
                msg = f"the node is no longer the slot's master: {exc}"
                raise redis.exceptions.ConnectionError(msg) from exc
            except redis.exceptions.ResponseError as exc:
                # the parser turns MOVED/ASK/TRYAGAIN/CLUSTERDOWN into their own classes and
                # drops the word; inside a script's error reply the word stays in the text
                if isinstance(exc, _moved_errors()) or str(exc).startswith(_MOVED_PREFIXES):
                    self.disconnect()
                    msg = f"slot {slot} moved: {type(exc).__name__} {exc}"
                    raise redis.exceptions.ConnectionError(msg) from exc
                raise

    SlotOwnerConnection.__name__ = f"SlotOwner{base.__name__}"
    SlotOwnerConnection.slot = slot
    return SlotOwnerConnection


def serves_one_slot(client: Any) -> bool:
    """Whether ``client`` talks to the master of one slot of a cluster (a tag's client)."""
    pool = getattr(client, "connection_pool", None)
    return hasattr(getattr(pool, "connection_class", None), "slot")


def namespace_client(
    url: str,
    options: dict[str, Any],
    namespace: str | None,
    client_options: dict[str, Any] | None = None,
) -> Any:
    """A client for one namespace of a Redis Cluster (or the cluster client, without one).

    ``options`` are the user's (password, TLS ...), for every connection; ``client_options``
    (retries, timeouts) go to the namespace's client only.
    """
    import redis

    locator = locator_for(url, options)
    if namespace is None:
        return locator.cluster()
    slot = namespace_slot(namespace)
    client = redis.Redis.from_url(node_url(url), **{**(client_options or {}), **options})
    pool = client.connection_pool
    pool.connection_class = slot_connection_class(pool.connection_class, locator, slot)
    return client
