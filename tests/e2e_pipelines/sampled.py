"""A sampling filter (non-deterministic) read by a keyed count on the other side of a shuffle.

events (Kafka, IDs from the event_id field) -> sample (keeps each event with chance 1/2, drawn
again by every attempt) -> by-user -> count (keyed state in Redis) -> counts (Kafka sink)

The source stage has no sink: nothing but the end of its task stands between its commits and
the count reading its outputs. Topics and the pipeline name come from the environment
(``ORDERS_PIPELINE``, ``ORDERS_IN``, ``ORDERS_COUNTS``), as for ``orders.py``.
"""

import os
import random

from onceflow import EventTime, KafkaSink, KafkaSource, Pipeline

pipeline = Pipeline(os.environ["ORDERS_PIPELINE"], event_time=EventTime.of(out_of_orderness="0"))
(
    pipeline.read(
        "events",
        KafkaSource(
            os.environ["ORDERS_IN"], id=lambda e: e["event_id"], timestamp=lambda e: e["ts"]
        ),
    )
    .filter("sample", lambda e: random.random() < 0.5)
    .key_by("by-user", lambda e: e["user"])
    .count_per_key("count")
    .write("counts", KafkaSink(os.environ["ORDERS_COUNTS"]))
)
