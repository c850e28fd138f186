"""The README's windows example: clicks per page per minute, with early and late panes.

``onceflow explain examples/clicks.py`` draws the window and trigger on the stage;
``onceflow run examples/clicks.py`` reads the ``clicks`` topic (JSON with ``page`` and ``ts``
in epoch milliseconds) and writes one pane per window and firing to ``clicks-per-minute``.
"""

from onceflow import EventTime, KafkaSink, KafkaSource, Pipeline
from onceflow.windows import Fixed, Trigger

pipeline = Pipeline("clicks", event_time=EventTime.of(out_of_orderness="30s"))
(
    pipeline.read("clicks", KafkaSource("clicks", timestamp=lambda c: c["ts"]))
    .key_by("by-page", lambda c: c["page"])
    .window(
        "per-minute",
        Fixed("1m"),
        trigger=Trigger(early_every=100),
        allowed_lateness="5m",
        accumulation="accumulating",
    )
    .count_per_key("count")
    .write("out", KafkaSink("clicks-per-minute"))
)
