"""confluent-kafka's settings: Onceflow's (kafka-python's names) translated to librdkafka's.

**Settings.** :class:`.connection.KafkaSettings` hold kafka-python's option names
(the driver reads offsets and creates topics with kafka-python); :func:`librdkafka_config`
maps them to librdkafka's (``sasl_plain_password`` -> ``sasl.password``, ``ssl_cafile`` ->
``ssl.ca.location`` ...). An option without an equivalent is refused, naming the option and
never its value, rather than dropped; a sink's producer ``options`` may also use librdkafka's
own dotted names, passed as they are. Nothing here prints a setting's value.

Kept apart from :mod:`.confluent` so that it imports without confluent-kafka installed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.kernel.errors import ConfigError

# kafka-python connection option -> librdkafka property (every client).
CONNECTION_NAMES: Mapping[str, str] = {
    "security_protocol": "security.protocol",
    "sasl_mechanism": "sasl.mechanism",
    "sasl_plain_username": "sasl.username",
    "sasl_plain_password": "sasl.password",
    "sasl_kerberos_service_name": "sasl.kerberos.service.name",
    "ssl_cafile": "ssl.ca.location",
    "ssl_certfile": "ssl.certificate.location",
    "ssl_keyfile": "ssl.key.location",
    "ssl_password": "ssl.key.password",
    "ssl_crlfile": "ssl.crl.location",
    "ssl_ciphers": "ssl.cipher.suites",
    "client_id": "client.id",
    "connections_max_idle_ms": "connections.max.idle.ms",
    "reconnect_backoff_ms": "reconnect.backoff.ms",
    "reconnect_backoff_max_ms": "reconnect.backoff.max.ms",
    "metadata_max_age_ms": "metadata.max.age.ms",
    "retry_backoff_ms": "retry.backoff.ms",
}
# kafka-python consumer options -> librdkafka (the reader; group options are harmless there).
CONSUMER_NAMES: Mapping[str, str] = {
    "session_timeout_ms": "session.timeout.ms",
    "heartbeat_interval_ms": "heartbeat.interval.ms",
    "fetch_max_bytes": "fetch.max.bytes",
    "max_partition_fetch_bytes": "max.partition.fetch.bytes",
    "fetch_max_wait_ms": "fetch.wait.max.ms",
    "fetch_min_bytes": "fetch.min.bytes",
    "request_timeout_ms": "socket.timeout.ms",
}
# kafka-python producer options -> librdkafka.
PRODUCER_NAMES: Mapping[str, str] = {
    "acks": "acks",
    "linger_ms": "linger.ms",
    "batch_size": "batch.size",
    "retries": "retries",
    "max_request_size": "message.max.bytes",
    "enable_idempotence": "enable.idempotence",
    "max_in_flight_requests_per_connection": "max.in.flight.requests.per.connection",
    "transactional_id": "transactional.id",
    "transaction_timeout_ms": "transaction.timeout.ms",
    "compression_type": "compression.type",
    "delivery_timeout_ms": "delivery.timeout.ms",
    "request_timeout_ms": "request.timeout.ms",
}
# kafka-python options that only steer kafka-python itself (librdkafka negotiates versions,
# takes a timeout with each call that may block, and connects in the background).
PYTHON_ONLY = frozenset(
    {"api_version", "api_version_auto_timeout_ms", "max_block_ms", "bootstrap_timeout_ms"}
)


def librdkafka_config(
    settings: KafkaSettings, options: Mapping[str, Any], names: Mapping[str, str], who: str
) -> dict[str, Any]:
    """Settings and ``options`` (kafka-python names, or librdkafka's dotted ones) for librdkafka.

    Connection settings must have an equivalent (they are kafka-python's, the driver uses
    them); ``options`` may also name librdkafka properties directly. Refusals name the
    option, never its value.
    """
    config: dict[str, Any] = {"bootstrap.servers": settings.bootstrap_servers}
    config.update(_translate(settings.options, CONNECTION_NAMES, who, dotted=False))
    config.update(_translate(options, {**CONNECTION_NAMES, **names}, who, dotted=True))
    return config


def _translate(
    options: Mapping[str, Any], names: Mapping[str, str], who: str, dotted: bool
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in options.items():
        if key in names:
            out[names[key]] = value
        elif key == "ssl_check_hostname":
            out["ssl.endpoint.identification.algorithm"] = "https" if value else "none"
        elif dotted and "." in key:
            out[key] = value
        elif key not in PYTHON_ONLY:
            known = ", ".join(sorted({*names, "ssl_check_hostname"}))
            msg = (
                f"{who}(client='confluent') has no librdkafka equivalent for the option {key!r} "
                f"(it translates {known}); remove it, give a producer option its librdkafka "
                "name, or use client='python'"
            )
            raise ConfigError(msg)
    return out
