"""``onceflow dev up|down``: a local Kafka, a durable Redis and PostgreSQL in one command.

Issue 42: the README said a run needs Kafka and a durable Redis, and the only way the project
started them was the demo or the test helpers. The stack is started as a newcomer would,
from the command line, and used as a pipeline would: a record through Kafka, a key through
Redis (AOF, ``appendfsync always``), a row through PostgreSQL; then stopped and started again
with its data.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import redis
from kafka import KafkaConsumer, KafkaProducer

pytestmark = [pytest.mark.kafka, pytest.mark.redis]


def dev(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "onceflow", "dev", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def exports(stdout: str) -> dict[str, str]:
    """What ``eval "$(onceflow dev up)"`` would set."""
    env = {}
    for line in stdout.splitlines():
        assert line.startswith("export "), line
        name, _, value = line[len("export ") :].partition("=")
        env[name] = shlex.split(value)[0]
    return env


def _read_all(bootstrap: str, topic: str) -> list[bytes]:
    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        consumer_timeout_ms=5000,
        isolation_level="read_committed",
    )
    try:
        return [m.value for m in consumer]
    finally:
        consumer.close()


def test_dev_up_starts_a_stack_that_keeps_its_data_across_down_and_up():
    # PostgreSQL runs as its own user: a folder it can reach (pytest's tmp_path is not)
    folder = tempfile.mkdtemp(prefix="onceflow-dev-test-")
    try:
        started = dev("up", "--dev-dir", folder, "--with", "postgres")
        assert started.returncode == 0, started.stderr
        env = exports(started.stdout)
        assert set(env) == {"KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL", "PG_CONNINFO", "PGPASSWORD"}
        producer = KafkaProducer(bootstrap_servers=env["KAFKA_BOOTSTRAP_SERVERS"])
        producer.send("dev-check", b"kept").get(30)
        producer.close()
        r = redis.Redis.from_url(env["REDIS_URL"])
        assert r.config_get("appendfsync")["appendfsync"] == "always", "durable: what runs ask"
        r.set("dev-check", "kept")
        import psycopg

        with psycopg.connect(env["PG_CONNINFO"], password=env["PGPASSWORD"]) as conn:
            conn.execute("CREATE TABLE dev_check (id int PRIMARY KEY)")
            conn.execute("INSERT INTO dev_check VALUES (1)")

        again = dev("up", "--dev-dir", folder, "--with", "postgres")
        assert again.returncode == 0 and exports(again.stdout) == env, "running: the same stack"
        assert "is running" in again.stderr

        assert dev("down", "--dev-dir", folder).returncode == 0
        with pytest.raises(redis.ConnectionError):
            r.ping()
        restarted = dev("up", "--dev-dir", folder, "--with", "postgres")
        assert restarted.returncode == 0, restarted.stderr
        env = exports(restarted.stdout)
        assert redis.Redis.from_url(env["REDIS_URL"]).get("dev-check") == b"kept"
        assert _read_all(env["KAFKA_BOOTSTRAP_SERVERS"], "dev-check") == [b"kept"]
        with psycopg.connect(env["PG_CONNINFO"], password=env["PGPASSWORD"]) as conn:
            assert conn.execute("SELECT id FROM dev_check").fetchall() == [(1,)]
    finally:
        stopped = dev("down", "--dev-dir", folder, "--wipe")
    assert stopped.returncode == 0, stopped.stderr
    assert not Path(folder).exists()


def test_dev_up_refuses_what_it_cannot_start(tmp_path):
    out = dev("up", "--dev-dir", str(tmp_path), "--with", "mysql")
    assert out.returncode == 2
    assert out.stderr.strip() == "error: onceflow dev up --with takes postgres, registry, got mysql"
    assert not os.listdir(tmp_path)
