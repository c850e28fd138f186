"""The pipeline the state time-to-live test runs: per-user counts that forget idle users.

events (Kafka, IDs from event_id) -> by-user -> count (state kept ``TTL_SECONDS`` of batch
time after a user's last update) -> counts (Kafka: user -> running count)

``TTL_PIPELINE``, ``TTL_IN``, ``TTL_OUT`` and ``TTL_SECONDS`` come from the environment;
``TTL_ON_EXPIRY=delete`` sends ``(user, None)`` (a tombstone) when a user's count expires.
"""

import os

from onceflow import KafkaSink, KafkaSource, Pipeline

env = os.environ
pipeline = Pipeline(env["TTL_PIPELINE"])
(
    pipeline.read("events", KafkaSource(env["TTL_IN"], id=lambda e: e["event_id"]))
    .key_by("by-user", lambda e: e["user"])
    .combine_per_key(
        "count",
        "count",
        ttl=f"{env['TTL_SECONDS']}s",
        on_expiry=env.get("TTL_ON_EXPIRY", "forget"),
    )
    .write("counts", KafkaSink(env["TTL_OUT"]))
)
