"""The demo's streaming pipeline: count events per user, exactly once.

events (Kafka, JSON, IDs from the event_id field) -> key by user -> count per user
-> counts (Kafka; key = user, value = the user's count so far)

Topics and the pipeline name come from the environment, so the demo can run it as a child
process (and kill it).
"""

import os

from onceflow import KafkaSink, KafkaSource, Pipeline

pipeline = Pipeline(os.environ.get("DEMO_PIPELINE", "demo-orders"))
(
    pipeline.read(
        "events",
        KafkaSource(
            os.environ.get("DEMO_EVENTS", "demo-events"),
            id=lambda e: e["event_id"],
            timestamp=lambda e: e["ts"],
        ),
    )
    .key_by("by-user", lambda e: e["user"])
    .count_per_key("count")
    .write("counts", KafkaSink(os.environ.get("DEMO_COUNTS", "demo-counts")))
)
