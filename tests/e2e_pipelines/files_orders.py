"""The file sinks' crash tests run this: events -> a non-deterministic map -> files.

events (Kafka, IDs from the event_id field) -> enrich (adds random noise) -> files (Parquet,
one folder per user; or JSON lines with ``FILES_FORMAT=jsonl``). Topics, the pipeline name
and the folder come from the environment (``ORDERS_PIPELINE``, ``ORDERS_IN``, ``PARQUET_OUT``).
"""

import os
import random

from onceflow import KafkaSource, Pipeline
from onceflow.sinks import JsonLines, Parquet

pipeline = Pipeline(os.environ["ORDERS_PIPELINE"])
pipeline.read(
    "events",
    KafkaSource(os.environ["ORDERS_IN"], id=lambda e: e["event_id"], timestamp=lambda e: e["ts"]),
).map("enrich", lambda e: {**e, "noise": random.random()}).write(
    "files",
    JsonLines(os.environ["PARQUET_OUT"])
    if os.environ.get("FILES_FORMAT") == "jsonl"
    else Parquet(os.environ["PARQUET_OUT"], partition_by=["user"], row_group_size=500),
)
