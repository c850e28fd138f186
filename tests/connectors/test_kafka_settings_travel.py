"""Kafka connection settings are read on the driver and travel inside the pickled connector.

On a cluster a worker's environment holds none of the driver's ``KAFKA_*`` variables: a
sink or source unpickled there must use what the driver resolved, and never print secrets.
They have one name on both sides (``connection=``); the sink's producer settings another
(``producer_options=``).
"""

from __future__ import annotations

import pickle

import pytest

from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.kafka import KafkaSink, KafkaSource
from onceflow.kernel.errors import ConfigError

SECRET = "s3cr3t-pa55"
DRIVER_ENV = {
    "KAFKA_BOOTSTRAP_SERVERS": "driver-side:9093",
    "KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
    "KAFKA_SASL_MECHANISM": "PLAIN",
    "KAFKA_SASL_USERNAME": "onceflow",
    "KAFKA_SASL_PASSWORD": SECRET,
}


def _on_a_worker(connector, monkeypatch):
    """The connector as a worker sees it: pickled, with no Kafka variables around."""
    data = pickle.dumps(connector)
    for name in DRIVER_ENV:
        monkeypatch.delenv(name, raising=False)
    return pickle.loads(data)


@pytest.mark.parametrize(
    "make",
    [lambda: KafkaSink("out", create_topic=False), lambda: KafkaSource("in")],
    ids=["sink", "source"],
)
def test_settings_resolved_on_the_driver_reach_a_worker_without_its_environment(make, monkeypatch):
    for name, value in DRIVER_ENV.items():
        monkeypatch.setenv(name, value)
    connector = make()
    connector.settings  # noqa: B018 - resolved on the driver, first thing prepare() does
    worker_side = _on_a_worker(connector, monkeypatch)
    settings = worker_side.settings
    assert settings.bootstrap_servers == "driver-side:9093"
    assert settings.options["sasl_plain_password"] == SECRET
    assert settings.options["security_protocol"] == "SASL_SSL"


def test_a_worker_does_not_pick_up_its_own_environment(monkeypatch):
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "driver-side:9093")
    sink = KafkaSink("out", create_topic=False)
    sink.settings  # noqa: B018 - resolved on the driver (prepare() also reads the topic)
    data = pickle.dumps(sink)
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "worker-side:9092")
    assert pickle.loads(data).settings.bootstrap_servers == "driver-side:9093"


def test_unresolved_settings_fail_clearly_where_nothing_is_configured(monkeypatch):
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    with pytest.raises(ConfigError, match="KAFKA_BOOTSTRAP_SERVERS"):
        KafkaSink("out", create_topic=False).prepare("p", streaming=False)


def test_secrets_are_never_printed(monkeypatch):
    for name, value in DRIVER_ENV.items():
        monkeypatch.setenv(name, value)
    sink = KafkaSink("out", create_topic=False, connection={"sasl_oauth_token": "tok-123"})
    sink.settings  # noqa: B018 - resolved on the driver (prepare() also reads the topic)
    shown = " ".join([repr(sink), str(sink), repr(sink.settings), sink.describe()])
    assert SECRET not in shown and "tok-123" not in shown
    assert "driver-side:9093" in repr(sink.settings)


LOGIN = {"security_protocol": "SASL_SSL", "sasl_plain_password": SECRET}


def _no_kafka_environment(monkeypatch):
    for name in DRIVER_ENV:
        monkeypatch.delenv(name, raising=False)


def test_connection_settings_have_one_name_on_both_sides(monkeypatch):
    _no_kafka_environment(monkeypatch)
    source = KafkaSource("in", bootstrap_servers="k:9092", connection=LOGIN)
    sink = KafkaSink(
        "out",
        bootstrap_servers="k:9092",
        connection=LOGIN,
        producer_options={"linger_ms": 50, "max_request_size": 5000},
    )
    assert source.settings.options == sink.settings.options == LOGIN
    assert "linger_ms" not in sink.settings.options, "producer settings reached every client"
    assert sink.user_options == {"linger_ms": 50, "max_request_size": 5000}
    assert sink.max_request_size == 5000


@pytest.mark.parametrize(
    ("make", "new"),
    [
        (lambda **kw: KafkaSource("in", bootstrap_servers="k:9092", **kw), "connection"),
        (lambda **kw: KafkaSink("out", bootstrap_servers="k:9092", **kw), "producer_options"),
    ],
    ids=["source", "sink"],
)
def test_the_old_options_name_still_works_for_one_release_and_says_the_new_one(
    make, new, monkeypatch
):
    _no_kafka_environment(monkeypatch)
    with pytest.warns(DeprecationWarning, match=rf"\(options=\.\.\.\) is deprecated.*{new}=") as w:
        connector = make(options=LOGIN)
    assert SECRET not in str(w[0].message)
    assert w[0].filename == __file__, "the warning points at the user's call"
    kept = connector.settings.options if new == "connection" else connector.user_options
    assert kept == LOGIN, "the old name changed meaning"
    with pytest.raises(ConnectorError, match=f"pass {new}= only") as both:
        make(options=LOGIN, **{new: LOGIN})
    assert SECRET not in str(both.value)
