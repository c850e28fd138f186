"""``onceflow reset`` refuses while a driver of the namespace runs (its heartbeat in Redis)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from onceflow.kernel.errors import ConfigError
from onceflow.kernel.keyspace import Keyspace
from onceflow.operations.reset import reset
from onceflow.operations.status import status
from onceflow.runtime.driver.heartbeat import DriverHeartbeat, driver_info, running_driver

pytestmark = pytest.mark.redis


def test_reset_refuses_while_a_driver_beats_and_goes_ahead_once_it_stopped(redis_server):
    client = redis_server.client()
    ks = Keyspace("reset-running")
    client.hset(ks.meta, mapping={"parallelism": 2, "layout": 3})
    beat = DriverHeartbeat(client, ks, driver_info(7, "reset-running")).start()
    try:
        assert running_driver(client, ks)["epoch"] == 7
        assert "running: process" in status(client, ks.namespace).text()
        with pytest.raises(ConfigError, match="is running .* driver epoch 7"):
            reset(client, ks.namespace, None)
        assert client.exists(ks.meta), "a refused reset deleted keys"
        assert reset(client, ks.namespace, None, dry_run=True).driver is not None
    finally:
        beat.stop()
    assert running_driver(client, ks) is None, "a driver that ended leaves its heartbeat"
    assert reset(client, ks.namespace, None).keys >= 1
    assert not client.exists(ks.meta)


def test_a_lost_driver_can_be_forced_out_and_its_heartbeat_expires(redis_server):
    client = redis_server.client()
    ks = Keyspace("reset-lost")
    client.hset(ks.meta, mapping={"parallelism": 2, "layout": 3})
    DriverHeartbeat(client, ks, driver_info(3, "reset-lost")).start().stopped.set()  # lost
    assert 0 < client.pttl(ks.driver) <= 30_000, "a lost driver's heartbeat must expire"
    with pytest.raises(ConfigError):
        reset(client, ks.namespace, None)
    assert reset(client, ks.namespace, None, force=True).keys >= 1


def test_the_cli_says_so_in_one_line(redis_server):
    client = redis_server.client()
    ks = Keyspace("reset-cli")
    client.hset(ks.meta, mapping={"parallelism": 2, "layout": 3})
    client.set(ks.driver, '{"pid": 42, "host": "h", "epoch": 5}', px=30_000)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "onceflow",
            "reset",
            "--namespace",
            ks.namespace,
            "--yes",
            "--redis-url",
            redis_server.url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "process 42 on h" in errors[0], done.stderr
    assert client.exists(ks.meta)
