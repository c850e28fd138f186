"""A host crash that tears a script's transaction in Redis's AOF applies nothing of it, ever.

Redis writes a script's effects to its AOF as one ``MULTI`` ... ``EXEC`` block. A crash of
the host can cut the file in the middle of a command of that block. Redis then loads what is
whole, discards the open block in memory (right) but truncates the file only back to the last
whole command, so the block stays open at the file's end (``aof-load-truncated``). The next
transaction written completes it, and the next start of the server applies the torn half: the
seen-marks of a commit without its backup, say. These tests play that on a real Redis 8 with
the cut placed inside the block, show the hazard, and show that
:func:`~onceflow.dedup.aof.settle_aof` (the AOF rewritten before the next script
writes; what the driver, every batch and GC do on a server that has not rewritten since it
started) leaves nothing of the torn transaction behind.
"""

from __future__ import annotations

import pytest
import redis as redis_py

from onceflow.dedup.aof import settle_aof, settled_info
from onceflow.testing.hostcrash import CrashableRedis

pytestmark = pytest.mark.redis

# three writes: Redis wraps them in MULTI/EXEC in the AOF
THREE_WRITES = """
redis.call('HSET', KEYS[1], 'a', ARGV[1])
redis.call('HSET', KEYS[1], 'b', ARGV[1])
redis.call('HSET', KEYS[1], 'c', ARGV[1])
return 1
"""


@pytest.fixture
def crashable(crashable_factory):
    return crashable_factory(appendfsync="always")


def _torn_commit(server: CrashableRedis) -> redis_py.Redis:
    """Write a three-write script, crash the host inside its AOF block, return a client."""
    client = redis_py.Redis.from_url(server.url)
    client.set("before", "1")
    (aof,) = server.aof_files()
    start = aof.stat().st_size
    client.eval(THREE_WRITES, 1, "torn", "x" * 2000)
    end = aof.stat().st_size
    assert end > start + 6000, "the script's block was not written to the AOF"
    # the cut falls in the middle of the third HSET's value: the block has MULTI and two
    # whole commands, no EXEC
    server.crash_host(keep_sizes={aof.name: end - 1000})
    client = redis_py.Redis.from_url(server.url)
    assert client.get("before") == b"1"
    assert client.hgetall("torn") == {}, "Redis applied part of a torn transaction on load"
    return client


def test_a_torn_transaction_comes_back_at_the_next_start_if_nothing_rewrites_the_aof(crashable):
    """The hazard itself (if a Redis release fixes it, this test says so)."""
    client = _torn_commit(crashable)
    client.eval(THREE_WRITES, 1, "next", "y")  # the next script completes the open block
    crashable.restart()
    client = redis_py.Redis.from_url(crashable.url)
    torn = client.hgetall("torn")
    assert torn, "this Redis no longer leaves a torn block open in its AOF: settle_aof is moot"
    assert set(torn) == {b"a", b"b"}, torn  # half a script, from a crash long ago


def test_settling_the_aof_before_the_next_script_leaves_nothing_of_the_torn_one(crashable):
    client = _torn_commit(crashable)
    run_id = settle_aof(client)
    assert settled_info(client)["run_id"] == run_id
    client.eval(THREE_WRITES, 1, "next", "y")
    crashable.restart()
    client = redis_py.Redis.from_url(crashable.url)
    assert client.hgetall("torn") == {}
    assert client.hgetall("next") == {b"a": b"y", b"b": b"y", b"c": b"y"}
    assert client.get("before") == b"1"


def test_a_settled_server_is_not_rewritten_again_and_a_restarted_one_is(crashable):
    client = redis_py.Redis.from_url(crashable.url)
    first = settle_aof(client)
    rewrites = int(client.info("persistence")["aof_rewrites"])
    assert settle_aof(client) == first
    assert int(client.info("persistence")["aof_rewrites"]) == rewrites
    crashable.restart()
    client = redis_py.Redis.from_url(crashable.url)
    assert int(client.info("persistence")["aof_rewrites"]) == 0
    assert settled_info(client)["run_id"] != first
    assert int(client.info("persistence")["aof_rewrites"]) == 1
