"""The pipeline the crash tests run: a non-deterministic map, a copy sink, a keyed count.

events (Kafka, IDs from the event_id field) -> enrich (adds random noise: non-deterministic)
  -> copy (Kafka sink)
  -> by-user -> count (keyed state in Redis) -> counts (Kafka sink)

Topics and the pipeline name come from the environment so each test has its own.
"""

import os
import random

from connectors.kafka import KafkaSink, KafkaSource
from pipeline import Pipeline

pipeline = Pipeline(os.environ["ORDERS_PIPELINE"])
enriched = pipeline.read(
    "events",
    KafkaSource(os.environ["ORDERS_IN"], id=lambda e: e["event_id"], timestamp=lambda e: e["ts"]),
).map("enrich", lambda e: {**e, "noise": random.random()})
enriched.write("copy", KafkaSink(os.environ["ORDERS_COPY"]))
(
    enriched.key_by("by-user", lambda e: e["user"])
    .count_per_key("count")
    .write("counts", KafkaSink(os.environ["ORDERS_COUNTS"]))
)
