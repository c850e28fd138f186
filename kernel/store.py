"""The storage layer: the one way the exactly-once machinery talks to Redis.

A :class:`Store` is one hash tag's Redis (a namespace's, or a partition scope's) as
``dedup``, ``backup`` and ``runtime`` use it: typed commands (bytes in Redis, bytes out), the
registered Lua scripts by name (their KEYS and ARGV from :mod:`onceflow.kernel.script_args`),
and :class:`Batch`, several commands in one round trip. The client under it is made with
Onceflow's one retry policy (:func:`onceflow.kernel.settings.retry_options`); a store never
makes one. :func:`store_for` gives the store of a client, once per client and process, so
callers that are handed a client (the driver's, a task's) share its scripts' registrations.

Nothing in ``dedup/``, ``backup/`` or ``runtime/`` calls a Redis client itself (a test in
``tests/architecture`` says so); operations tools and test helpers may.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from onceflow.kernel.errors import ServerChangedError
from onceflow.kernel.scripts import Scripts, scripts_for

if TYPE_CHECKING:
    from typing import TypeAlias

    import redis
    from redis.client import Pipeline

    Client: TypeAlias = redis.Redis[bytes]
    # What the machinery is handed: a client (the store is made once per client), or a store.
    Connection: TypeAlias = "Client | Store"

Value = bytes | str | int | float
Field = bytes | str
Fields = Mapping[bytes, Value] | Mapping[str, Value]
Scores = Mapping[bytes, float] | Mapping[str, float]
_MS_PER_S = 1000
SCRIPTS_LOST = (
    "the Redis server no longer knows a script loaded a moment before (NoScriptError): it "
    "restarted, failed over or crashed in between, so the micro-batch is not committed and is "
    "run again from what Redis kept"
)
_US_PER_MS = 1000


class Batch:
    """Commands sent together, in order, in one round trip (no transaction).

    Each method queues a command; :meth:`execute` sends them and returns their replies in
    order. One connection carries them all, so a ``WAIT``/``WAITAOF`` queued after a write
    waits for that write.
    """

    def __init__(self, pipe: Pipeline[bytes], scripts: Scripts) -> None:
        self._pipe = pipe
        self._scripts = scripts

    def get(self, key: str) -> None:
        """Queue ``GET``."""
        self._pipe.get(key)

    def exists(self, key: str) -> None:
        """Queue ``EXISTS``."""
        self._pipe.exists(key)

    def hget(self, key: str, field: Field) -> None:
        """Queue ``HGET``."""
        self._pipe.hget(key, field)

    def hgetall(self, key: str) -> None:
        """Queue ``HGETALL``."""
        self._pipe.hgetall(key)

    def hkeys(self, key: str) -> None:
        """Queue ``HKEYS``."""
        self._pipe.hkeys(key)

    def hexists(self, key: str, field: Field) -> None:
        """Queue ``HEXISTS``."""
        self._pipe.hexists(key, field)

    def hset(self, key: str, field: Field, value: Value) -> None:
        """Queue ``HSET`` of one field."""
        self._pipe.hset(key, field, value)

    def hsetnx(self, key: str, field: Field, value: Value) -> None:
        """Queue ``HSETNX`` of one field."""
        self._pipe.hsetnx(key, field, value)

    def hset_many(self, key: str, mapping: Fields) -> None:
        """Queue ``HSET`` of several fields."""
        self._pipe.hset(key, mapping={k: v for k, v in mapping.items()})

    def set(self, key: str, value: Value) -> None:
        """Queue ``SET``."""
        self._pipe.set(key, value)

    def delete(self, *keys: str) -> None:
        """Queue ``DEL`` (of at least one key)."""
        self._pipe.delete(*keys)

    def unlink(self, *keys: str) -> None:
        """Queue ``UNLINK`` (``DEL``, the memory freed in the background)."""
        self._pipe.unlink(*keys)

    def rename(self, key: str, new: str) -> None:
        """Queue ``RENAME`` (both keys in one hash tag on a cluster)."""
        self._pipe.rename(key, new)

    def zrange_all(self, key: str) -> None:
        """Queue ``ZRANGE key 0 -1 WITHSCORES``: every member and its score."""
        self._pipe.zrange(key, 0, -1, withscores=True)

    def hdel(self, key: str, *fields: Field) -> None:
        """Queue ``HDEL``."""
        self._pipe.hdel(key, *fields)

    def zadd(self, key: str, scores: Scores) -> None:
        """Queue ``ZADD``."""
        self._pipe.zadd(key, {k: v for k, v in scores.items()})

    def zrem(self, key: str, *members: Field) -> None:
        """Queue ``ZREM``."""
        self._pipe.zrem(key, *members)

    def zrange_first(self, key: str) -> None:
        """Queue ``ZRANGE key 0 0 WITHSCORES``: the lowest member and its score."""
        self._pipe.zrange(key, 0, 0, withscores=True)

    def zrangebyscore(self, key: str, low: float | str, high: float | str) -> None:
        """Queue ``ZRANGEBYSCORE`` (members only)."""
        self._pipe.zrangebyscore(key, low, high)

    def info(self, *sections: str) -> None:
        """Queue ``INFO``."""
        self._pipe.info(*sections)

    def wait(self, replicas: int, timeout_ms: int) -> None:
        """Queue ``WAIT``: the writes before it reached ``replicas`` replicas."""
        self._pipe.wait(replicas, timeout_ms)

    def waitaof(self, timeout_ms: int) -> None:
        """Queue ``WAITAOF 1 0``: the writes before it are fsynced to the local AOF."""
        self._pipe.execute_command("WAITAOF", 1, 0, timeout_ms)  # type: ignore[no-untyped-call]

    def script(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> None:
        """Queue a registered script (see :mod:`onceflow.kernel.scripts`)."""
        getattr(self._scripts, name)(keys=list(keys), args=list(args), client=self._pipe)

    def execute(self) -> list[Any]:
        """Send the queued commands; their replies, in order.

        redis-py loads the batch's scripts just before it sends them; a server that
        restarted, failed over or crashed in between (a retried send reaches the new one)
        answers ``NoScriptError``: a server change, raised as :class:`ServerChangedError` so
        that the batch is run again like after any other server change.
        """
        import redis

        try:
            return list(self._pipe.execute())
        except redis.exceptions.NoScriptError as exc:
            raise ServerChangedError(SCRIPTS_LOST) from exc


class Store:
    """One hash tag's Redis, typed (see the module docstring)."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.scripts = scripts_for(client)
        self.one_info_section = False  # the server takes one INFO section per call

    def batch(self) -> Batch:
        """Commands to send in one round trip."""
        return Batch(self.client.pipeline(transaction=False), self.scripts)

    def transaction(self) -> Batch:
        """Commands to send in one round trip and apply at once (``MULTI``/``EXEC``)."""
        return Batch(self.client.pipeline(transaction=True), self.scripts)

    def delete(self, *keys: str) -> None:
        """``DEL`` (of at least one key)."""
        self.client.delete(*keys)

    def script(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run a registered script (EVALSHA; loaded again after a Redis restart).

        redis-py loads a script the server does not know and calls it again; should the
        server change between that load and the call, it is a server change
        (:class:`ServerChangedError`), as in :meth:`Batch.execute`.
        """
        import redis

        try:
            return getattr(self.scripts, name)(keys=list(keys), args=list(args))
        except redis.exceptions.NoScriptError as exc:
            raise ServerChangedError(SCRIPTS_LOST) from exc

    def get(self, key: str) -> bytes | None:
        """``GET``."""
        return self.client.get(key)

    def set(self, key: str, value: Value, px: int | None = None) -> None:
        """``SET`` (with a time-to-live in ms, ``px``)."""
        self.client.set(key, value, px=px)

    def waitaof(self, timeout_ms: int) -> bool | None:
        """``WAITAOF 1 0``: whether the writes before it reached the local AOF in time.

        None when it cannot be asked (a Redis before 7.2, or without an AOF).
        """
        import redis

        try:
            reply = self.client.execute_command("WAITAOF", 1, 0, timeout_ms)
        except redis.exceptions.ResponseError:
            return None
        return int(reply[0]) >= 1

    def set_nx(self, key: str, value: Value, px: int) -> bool:
        """``SET NX PX``: whether ``key`` was absent (and now holds ``value``)."""
        return bool(self.client.set(key, value, px=px, nx=True))

    def incr(self, key: str) -> int:
        """``INCR``: the value after it (the driver epoch)."""
        return int(self.client.incr(key))

    def exists(self, key: str) -> bool:
        """``EXISTS`` of one key."""
        return bool(self.client.exists(key))

    def hget(self, key: str, field: Field) -> bytes | None:
        """``HGET``."""
        return self.client.hget(key, field)

    def hgetall(self, key: str) -> dict[bytes, bytes]:
        """``HGETALL``."""
        return dict(self.client.hgetall(key))

    def hmget(self, key: str, fields: Sequence[Field]) -> list[bytes | None]:
        """``HMGET``."""
        return list(self.client.hmget(key, list(fields)))

    def hexists(self, key: str, field: Field) -> bool:
        """``HEXISTS``."""
        return bool(self.client.hexists(key, field))

    def hset(self, key: str, field: Field, value: Value) -> None:
        """``HSET`` of one field."""
        self.client.hset(key, field, value)

    def hset_many(self, key: str, mapping: Fields) -> None:
        """``HSET`` of several fields."""
        self.client.hset(key, mapping={k: v for k, v in mapping.items()})

    def hsetnx(self, key: str, field: Field, value: Value) -> bool:
        """``HSETNX``: whether the field was new."""
        return bool(self.client.hsetnx(key, field, value))

    def info(self, *sections: str) -> dict[str, Any]:
        """``INFO`` of ``sections``, merged (Redis before 7 takes one section per call)."""
        if len(sections) < 2 or self.one_info_section:
            return _merged_info(self.client, sections)
        from redis.exceptions import ResponseError

        try:
            return dict(self.client.info(*sections))
        except ResponseError as exc:
            if "syntax" not in str(exc).lower():
                raise
            self.one_info_section = True  # Redis 6: "syntax error" for several sections
            return _merged_info(self.client, sections)

    def config_get(self, name: str) -> str | None:
        """One ``CONFIG GET`` value (None when the server does not say)."""
        value = self.client.config_get(name).get(name)
        return None if value is None else str(value)

    def rewrite_aof(self) -> None:
        """``BGREWRITEAOF``."""
        self.client.bgrewriteaof()

    def scan(self, cursor: int, match: str, count: int) -> tuple[int, list[bytes]]:
        """One ``SCAN`` step: the next cursor (0: done) and the keys it found."""
        following, keys = self.client.scan(cursor, match=match, count=count)
        return int(following), list(keys)

    def scan_iter(self, match: str, count: int) -> Iterator[bytes]:
        """Every key matching ``match`` (``SCAN`` steps of ``count``)."""
        yield from self.client.scan_iter(match=match, count=count)

    def time_ms(self) -> int:
        """Redis's clock, in ms."""
        seconds, micros = self.client.time()
        return int(seconds) * _MS_PER_S + int(micros) // _US_PER_MS


_STORES: dict[int, Store] = {}


def store_for(client: Connection) -> Store:
    """The store of ``client`` (one per client and process, like its scripts)."""
    if isinstance(client, Store):
        return client
    found = _STORES.get(id(client))
    if found is None or found.client is not client:
        found = Store(client)
        _STORES[id(client)] = found
    return found


def _merged_info(client: Client, sections: Sequence[str]) -> dict[str, Any]:
    """``INFO`` of each section in turn, merged into one reply."""
    merged: dict[str, Any] = {}
    for section in sections or ("default",):
        merged.update(client.info(section))
    return merged
