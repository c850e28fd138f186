"""Durability refusal, password pass-through, ``onceflow audit`` and the demo, for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import produce
from onceflow.kernel.errors import ServiceError
from onceflow.kernel.settings import RedisSettings, check_durable, redis_client
from onceflow.operations.audit import audit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.redis
def test_a_redis_without_persistence_is_refused_unless_the_user_opts_out(redis_factory):
    server = redis_factory()
    client = redis_client(RedisSettings(server.url))
    assert "appendonly=yes" in check_durable(client, False)
    client.config_set("appendonly", "no")
    with pytest.raises(ServiceError, match="persistence is off"):
        check_durable(client, False)
    assert "appendonly=no" in check_durable(client, True)


@pytest.mark.redis
def test_passwords_pass_through_from_the_environment(redis_factory, monkeypatch):
    server = redis_factory()
    import redis

    redis.Redis.from_url(server.url).config_set("requirepass", "s3cret-pw")
    monkeypatch.setenv("REDIS_PASSWORD", "s3cret-pw")
    settings = RedisSettings.from_env(server.url)
    assert "s3cret" not in repr(settings)
    assert redis_client(settings).ping()
    monkeypatch.setenv("REDIS_PASSWORD", "wrong")
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(server.url, **RedisSettings.from_env(server.url).options).ping()


def test_kafka_secrets_pass_through_and_are_masked(monkeypatch):
    monkeypatch.setenv("KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("KAFKA_SASL_MECHANISM", "PLAIN")
    monkeypatch.setenv("KAFKA_SASL_USERNAME", "svc")
    monkeypatch.setenv("KAFKA_SASL_PASSWORD", "hunter2")
    monkeypatch.setenv("KAFKA_SSL_CAFILE", "/etc/ca.pem")
    s = KafkaSettings.from_env("broker:9093")
    cfg = s.client_config()
    assert cfg["sasl_plain_password"] == "hunter2" and cfg["ssl_cafile"] == "/etc/ca.pem"
    assert cfg["security_protocol"] == "SASL_SSL" and "hunter2" not in repr(s)


@pytest.mark.kafka
def test_audit_counts_duplicates_conflicts_and_gaps(broker, topic_name):
    settings = KafkaSettings(broker.bootstrap)
    inp, out = topic_name("audit-in"), topic_name("audit-out")
    events = [{"event_id": str(uuid.uuid4()), "n": i} for i in range(100)]
    produce(settings, inp, [(None, json.dumps(e).encode(), None) for e in events + events[:5]])
    rid = lambda i: i.to_bytes(16, "big")  # noqa: E731
    records = [(None, json.dumps(e).encode(), [("onceflow-id", rid(e["n"]))]) for e in events[:97]]
    records += records[:4]  # the sink's crash window: same ID, same value
    records.append((None, b'{"other": 1}', [("onceflow-id", rid(0))]))  # a conflicting copy
    produce(settings, out, records)
    report = audit(settings, out, inp, "event_id")
    assert report.records == 102 and report.distinct_ids == 97
    assert report.duplicated_ids == 4 and report.extra_copies == 5
    assert report.conflicting_ids == 1 and not report.ok
    assert report.input_duplicates == 5 and report.gaps == 3
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "onceflow",
            "audit",
            "--topic",
            out,
            "--input-topic",
            inp,
            "--match-field",
            "event_id",
            "--bootstrap-servers",
            broker.bootstrap,
            "--json",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert cli.returncode == 1 and json.loads(cli.stdout)["gaps"] == 3


@pytest.mark.crash
@pytest.mark.kafka
@pytest.mark.redis
def test_the_demo_crashes_resumes_and_reports_no_loss(broker, redis_server):
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap, "REDIS_URL": redis_server.url}
    run = subprocess.run(
        [sys.executable, "-m", "onceflow", "demo", "--events", "4000"],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    text = run.stdout
    assert "lost" in text and "duplicated" in text
    for line in text.splitlines():
        if line.strip().startswith(("lost", "duplicated")):
            assert line.split()[-1] == "0", line
