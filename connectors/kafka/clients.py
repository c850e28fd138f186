"""Kafka clients shared per process, and topic administration."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from onceflow.kernel.settings import KafkaSettings

_clients: dict[tuple[str, str], Any] = {}
_clients_lock = threading.Lock()


def shared_client(kind: str, settings: KafkaSettings, **extra: Any) -> Any:
    """A cached producer/consumer for these settings in this process (a new one costs ~0.1 s)."""
    key = (
        kind,
        repr((settings.bootstrap_servers, sorted(settings.options.items()), sorted(extra.items()))),
    )
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            from kafka import KafkaConsumer, KafkaProducer

            config = {**settings.client_config(), **extra}
            if kind == "producer":
                client = KafkaProducer(**config)
            else:
                client = KafkaConsumer(**config)
            _clients[key] = client
    return client


# Let the cluster choose the replication factor (its default.replication.factor): a fixed 1
# would make acks=all meaningless on a cluster with replicas.
CLUSTER_DEFAULT_REPLICATION = -1


def ensure_topics(
    settings: KafkaSettings,
    topics: Sequence[str],
    partitions: int,
    configs: dict[str, str] | None = None,
) -> None:
    """Create missing topics with the cluster's default replication factor."""
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(**settings.client_config())
    try:
        existing = set(admin.list_topics())
        missing = [t for t in topics if t not in existing]
        if missing:
            try:
                admin.create_topics(
                    [
                        NewTopic(t, partitions, CLUSTER_DEFAULT_REPLICATION, topic_configs=configs)
                        for t in missing
                    ]
                )
            except TopicAlreadyExistsError:
                pass
    finally:
        admin.close()
