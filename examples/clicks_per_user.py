"""Clicks per user and minute, from Kafka to Kafka: the testing tutorial's windowed example.

``onceflow run examples/clicks_per_user.py`` (or test it: ``tests/docs/test_tutorial.py``).
"""

from onceflow import EventTime, KafkaSink, KafkaSource, Pipeline, Trigger
from onceflow.windows import Fixed

pipeline = Pipeline("clicks-per-user", event_time=EventTime.of(out_of_orderness="5s"))
(
    pipeline.read(
        "clicks",
        KafkaSource("clicks", id=lambda c: c["click_id"], timestamp=lambda c: c["ts"]),
    )
    .filter("valid", lambda c: c.get("user") is not None)
    .key_by("by-user", lambda c: c["user"])
    .map_values("one", lambda c: 1)
    .window("minute", Fixed("1m"), trigger=Trigger(early_every=3), allowed_lateness="30s")
    .combine_per_key("clicks-per-minute", "sum")
    .write("per-minute", KafkaSink("clicks-per-user-per-minute"))
)
