"""Kafka-to-Kafka exactly-once against a broker and Redis in containers (testcontainers).

Each test starts its own broker and Redis containers, runs the orders pipeline
(``tests/e2e_pipelines/orders.py``: a non-deterministic map, a copy sink, a keyed count) on
local Spark against them, injects one fault, and checks with an independent count that every
input appears exactly once: in keyed state, in the counts topic and in the copy topic.

Faults: none (a full run); the broker container stopped and started mid-run; Redis paused and
resumed mid-run; the pipeline killed (SIGKILL of every process) and restarted.
"""

from __future__ import annotations

import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from onceflow.testing.harness import Crash, crash_and_resume, run_pipeline
from onceflow.testing.services import free_port
from tests.e2e.engine import KAFKA_DATA, Engine, find_engine, kafka_env
from tests.exactly_once.scenario import PIPELINE, make_scenario, run_with_fault, verify

pytestmark = [pytest.mark.e2e, pytest.mark.crash]

_LOG: list[str] = []
_FOUND: tuple[Engine | None, str] | None = None


def _engine() -> Engine:
    global _FOUND  # noqa: PLW0603 - one detection per test session
    if _FOUND is None:
        t0 = time.monotonic()
        _FOUND = find_engine(_LOG)
        _LOG.append(f"engine: {_FOUND[1]} ({time.monotonic() - t0:.1f} s)")
        print("\n".join(_LOG), file=sys.stderr)
    engine, why = _FOUND
    if engine is None:
        pytest.skip(f"no container engine: {why}")
    return engine


@dataclass
class Services:
    bootstrap: str
    redis_url: str
    broker: Any  # the docker-py container objects
    redis: Any

    def client(self) -> Any:
        import redis

        return redis.Redis.from_url(self.redis_url)


def _wait(check: Any, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception as exc:  # noqa: BLE001
            last = exc
        time.sleep(0.2)
    msg = f"{what} not ready within {timeout:.0f} s: {last}"
    raise AssertionError(msg)


def _kafka_ready(bootstrap: str) -> bool:
    from kafka import KafkaAdminClient

    host, port = bootstrap.rsplit(":", 1)
    # A plain connect first: a client made while the broker is down backs off for seconds.
    socket.create_connection((host, int(port)), 1).close()
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=3000)
    try:
        admin.list_topics()
        return True
    finally:
        admin.close()


@pytest.fixture
def services() -> Iterator[Services]:
    from testcontainers.core.container import DockerContainer

    engine = _engine()
    started: list[Any] = []
    # The broker's storage, on the host: it outlives a stop and start of the container.
    data = tempfile.mkdtemp(prefix="onceflow-e2e-kafka-")
    try:
        if engine.host_network:
            kafka_port, controller_port, redis_port = free_port(), free_port(), free_port()
            broker = (
                DockerContainer(engine.broker_image)
                .with_volume_mapping(data, KAFKA_DATA, "rw")
                .with_kwargs(network_mode="host")
            )
            for name, value in kafka_env(kafka_port, controller_port).items():
                broker.with_env(name, value)
            redis = (
                DockerContainer(engine.redis_image)
                .with_command(
                    f"--port {redis_port} --bind 127.0.0.1 --appendonly yes --appendfsync always "
                    "--save '' --dir /tmp --protected-mode no"
                )
                .with_kwargs(network_mode="host")
            )
            broker.start()
            started.append(broker)
            redis.start()
            started.append(redis)
            bootstrap = f"127.0.0.1:{kafka_port}"
            redis_url = f"redis://127.0.0.1:{redis_port}/0"
        else:
            kafka_port = free_port()
            broker = (
                DockerContainer(engine.broker_image)
                .with_env("KAFKA_NODE_ID", "1")
                .with_env("KAFKA_PROCESS_ROLES", "broker,controller")
                .with_env("KAFKA_LISTENERS", "PLAINTEXT://:9092,CONTROLLER://:9093")
                .with_env("KAFKA_ADVERTISED_LISTENERS", f"PLAINTEXT://127.0.0.1:{kafka_port}")
                .with_env("KAFKA_CONTROLLER_LISTENER_NAMES", "CONTROLLER")
                .with_env(
                    "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP",
                    "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
                )
                .with_env("KAFKA_CONTROLLER_QUORUM_VOTERS", "1@localhost:9093")
                .with_env("KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR", "1")
                .with_env("KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR", "1")
                .with_env("KAFKA_TRANSACTION_STATE_LOG_MIN_ISR", "1")
                .with_bind_ports(9092, kafka_port)
            )
            redis = (
                DockerContainer(engine.redis_image)
                .with_command("redis-server --appendonly yes --appendfsync always --save ''")
                .with_exposed_ports(6379)
            )
            broker.start()
            started.append(broker)
            redis.start()
            started.append(redis)
            bootstrap = f"127.0.0.1:{kafka_port}"
            redis_url = f"redis://127.0.0.1:{redis.get_exposed_port(6379)}/0"
        svc = Services(
            bootstrap, redis_url, broker.get_wrapped_container(), redis.get_wrapped_container()
        )
        _wait(lambda: _kafka_ready(bootstrap), "broker container")
        _wait(lambda: svc.client().ping(), "redis container")
        yield svc
    finally:
        for c in reversed(started):
            try:
                c.stop()
            except Exception:  # noqa: BLE001, S110 - best effort cleanup
                pass
        shutil.rmtree(data, ignore_errors=True)


def _scenario(services: Services, tmp_path: Any) -> Any:
    return make_scenario(services, services.redis_url, tmp_path, seed=13)


@pytest.mark.long  # CI time (~19 s): the killed-and-restarted run below is a full run too
def test_full_run_in_containers_is_exact(services, tmp_path):
    scn = _scenario(services, tmp_path)
    run_pipeline(PIPELINE, scn.args, env=scn.env).check()
    verify(scn, services.client())


@pytest.mark.long  # the local suite bounces Redis and kills runs; this one is the container twin
def test_broker_container_stopped_and_started_mid_run(services, tmp_path):
    scn = _scenario(services, tmp_path)

    def bounce() -> None:
        services.broker.stop(timeout=5)
        time.sleep(3)
        services.broker.start()

    lines = run_with_fault(scn, bounce)
    print(f"broker stop/start: first run {lines[-1].strip()}", file=sys.stderr)
    if lines[-1] != "exit status 0\n":
        # The broker was gone long enough for the run to give up: a supervisor restarts it.
        _wait(lambda: _kafka_ready(services.bootstrap), "broker container after restart")
        run_pipeline(PIPELINE, scn.args, env=scn.env).check()
    verify(scn, services.client())


@pytest.mark.long
def test_redis_container_paused_and_resumed_mid_run(services, tmp_path):
    scn = _scenario(services, tmp_path)

    def pause() -> None:
        services.redis.pause()
        time.sleep(5)
        services.redis.unpause()

    lines = run_with_fault(scn, pause)
    assert lines[-1] == "exit status 0\n", "".join(lines[-40:])
    verify(scn, services.client())


def test_pipeline_killed_and_restarted_against_containers(services, tmp_path):
    scn = _scenario(services, tmp_path)
    first, second = crash_and_resume(
        PIPELINE, Crash("after_commit", stage="count", batch=2), scn.args, env=scn.env
    )
    assert first.crashed and second.returncode == 0
    verify(scn, services.client())
