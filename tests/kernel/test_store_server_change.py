"""A Redis server that restarts between a script's load and its call is a server change.

redis-py loads a batch's scripts (``SCRIPT EXISTS`` / ``SCRIPT LOAD``) just before it sends
the batch; a server that restarts in between (its script cache empty) answers the retried
send with ``NoScriptError``. That must read as :class:`ServerChangedError` — the micro-batch
runs again — and never stop the run (issue 37: the host-crash torture on Redis 8 stopped on
``NoScriptError: ... EVALSHA``).
"""

from __future__ import annotations

import pytest
import redis as redis_py
from redis.client import Pipeline

from onceflow.kernel.errors import ServerChangedError
from onceflow.kernel.settings import retry_options
from onceflow.kernel.store import Store
from onceflow.runtime.driver.batch_run import server_changed

pytestmark = pytest.mark.redis


def _restart_after_loading(monkeypatch: pytest.MonkeyPatch, server) -> list[int]:
    """Restart ``server`` (kill -9, same files) right after redis-py loaded a batch's scripts."""
    restarts: list[int] = []
    load = Pipeline.load_scripts

    def load_then_restart(pipe: Pipeline) -> None:
        load(pipe)
        if not restarts:
            server.restart(kill=True)
            restarts.append(1)

    monkeypatch.setattr(Pipeline, "load_scripts", load_then_restart)
    return restarts


def test_a_batch_whose_server_restarted_after_loading_its_script_is_a_server_change(
    redis_factory, monkeypatch
):
    server = redis_factory()
    client = redis_py.Redis.from_url(server.url, **retry_options(retries=20, cap_s=0.2))
    store = Store(client)
    store.set("k", b"v")
    restarts = _restart_after_loading(monkeypatch, server)
    batch = store.batch()
    batch.get("k")
    batch.script("delete_if_equal", ["k"], [b"other"])
    with pytest.raises(ServerChangedError, match="NoScriptError") as caught:
        batch.execute()
    assert restarts == [1]
    assert server_changed(caught.value)
    # the driver also recognises it in a task's failure, which reaches it as text
    assert server_changed(RuntimeError(f"Py4JJavaError: ... {caught.value!r}"))
    # the next batch on the new server runs (redis-py loads the script again)
    batch = store.batch()
    batch.script("delete_if_equal", ["k"], [b"v"])
    assert batch.execute() == [1]


def test_without_a_restart_a_batch_of_scripts_just_runs(redis_factory):
    server = redis_factory()
    store = Store(redis_py.Redis.from_url(server.url, **retry_options(retries=5, cap_s=0.2)))
    store.set("k", b"v")
    batch = store.batch()
    batch.script("delete_if_equal", ["k"], [b"v"])
    batch.get("k")
    assert batch.execute() == [1, None]
