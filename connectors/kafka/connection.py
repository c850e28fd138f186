"""Where Kafka is and how to log in, with passwords and TLS passed straight through.

:class:`KafkaSettings` reads the environment when a value is not given:
``KAFKA_BOOTSTRAP_SERVERS``, ``KAFKA_SECURITY_PROTOCOL``, ``KAFKA_SASL_MECHANISM``,
``KAFKA_SASL_USERNAME``, ``KAFKA_SASL_PASSWORD``, ``KAFKA_SSL_CAFILE``, ``KAFKA_SSL_CERTFILE``,
``KAFKA_SSL_KEYFILE``. Anything else a client accepts goes in ``options``. Settings pickle to
the workers; secrets are never printed (``repr`` masks them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from onceflow.kernel.durations import parse_duration_ms
from onceflow.kernel.errors import ConfigError
from onceflow.kernel.settings import from_environment, mask_secrets

KAFKA_START_WAIT_ENV = "ONCEFLOW_KAFKA_START_WAIT"
KAFKA_OUTAGE_WAIT_ENV = "ONCEFLOW_KAFKA_OUTAGE_WAIT"
DEFAULT_KAFKA_START_WAIT_S = 60.0
DEFAULT_KAFKA_OUTAGE_WAIT_S = 180.0


@dataclass(frozen=True)
class KafkaSettings:
    """Where Kafka is and how to log in; ``options`` go to every kafka-python client.

    ``start_wait_s``: how long a run waits for Kafka to answer at all when it starts
    (``$ONCEFLOW_KAFKA_START_WAIT``); ``outage_wait_s``: how long a running pipeline's Kafka
    step waits for a broker that went away, before the run stops
    (``$ONCEFLOW_KAFKA_OUTAGE_WAIT``). See :mod:`onceflow.connectors.kafka.outage`.
    """

    bootstrap_servers: str
    options: dict[str, Any] = field(default_factory=dict, hash=False)
    start_wait_s: float = DEFAULT_KAFKA_START_WAIT_S
    outage_wait_s: float = DEFAULT_KAFKA_OUTAGE_WAIT_S

    @classmethod
    def from_env(cls, bootstrap_servers: str | None = None, **options: Any) -> KafkaSettings:
        """Settings from arguments, falling back to the environment."""
        servers = bootstrap_servers or os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
        if not servers:
            msg = (
                "no Kafka configured: pass bootstrap_servers=... or set KAFKA_BOOTSTRAP_SERVERS "
                "(host:9092)"
            )
            raise ConfigError(msg)
        env = {
            "security_protocol": "KAFKA_SECURITY_PROTOCOL",
            "sasl_mechanism": "KAFKA_SASL_MECHANISM",
            "sasl_plain_username": "KAFKA_SASL_USERNAME",
            "sasl_plain_password": "KAFKA_SASL_PASSWORD",
            "ssl_cafile": "KAFKA_SSL_CAFILE",
            "ssl_certfile": "KAFKA_SSL_CERTFILE",
            "ssl_keyfile": "KAFKA_SSL_KEYFILE",
        }
        return cls(
            servers,
            from_environment(env, options),
            wait_from_env(KAFKA_START_WAIT_ENV, DEFAULT_KAFKA_START_WAIT_S),
            wait_from_env(KAFKA_OUTAGE_WAIT_ENV, DEFAULT_KAFKA_OUTAGE_WAIT_S),
        )

    def client_config(self) -> dict[str, Any]:
        """Keyword arguments shared by producers, consumers and admin clients."""
        return {"bootstrap_servers": self.bootstrap_servers.split(","), **self.options}

    def __repr__(self) -> str:
        return f"KafkaSettings({self.bootstrap_servers!r}, {mask_secrets(self.options)})"


def wait_from_env(variable: str, default_s: float) -> float:
    """A wait in seconds from a duration in the environment (``90s``, ``3m``), else the default."""
    text = os.environ.get(variable)
    if not text:
        return default_s
    return parse_duration_ms(text, variable) / 1000
