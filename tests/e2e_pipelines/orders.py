"""The pipeline the crash tests run: a non-deterministic map, a copy sink, a keyed count.

events (Kafka, IDs from the event_id field) -> enrich (adds random noise: non-deterministic)
  -> copy (Kafka sink)
  -> by-user -> count (keyed state in Redis) -> counts (Kafka sink)

Topics and the pipeline name come from the environment so each test has its own;
``ORDERS_HORIZON`` / ``ORDERS_BUCKET`` (e.g. ``5m`` / ``1m``) shorten the dedup horizon for
the GC tests.
"""

import os
import random

from onceflow import DedupConfig, KafkaSink, KafkaSource, Pipeline

dedup = None
if os.environ.get("ORDERS_HORIZON"):
    dedup = DedupConfig.of(
        horizon=os.environ["ORDERS_HORIZON"],
        bucket=os.environ.get("ORDERS_BUCKET", "1m"),
        skew_ms=int(os.environ.get("ORDERS_SKEW_MS", "5000")),
    )
pipeline = Pipeline(os.environ["ORDERS_PIPELINE"], dedup=dedup)
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
