"""Two unrelated steps the optimizer fuses into one stage (siblings of one key exchange).

events (Kafka, IDs from ``event_id``) -> by-user -> a ``process`` step counting each user's
events (named by ``ALERT_STEP``, default ``alert``: a rename is the test) and, beside it, the
revenue per user (``combine_per_key``). Topics and the pipeline name come from the
environment (``SIB_PIPELINE``, ``SIB_IN``, ``SIB_ALERTS``, ``SIB_OUT``).
"""

import os

from onceflow import KafkaSink, KafkaSource, Pipeline
from onceflow.state import ValueSpec

COUNT = ValueSpec[int]("count")


def every_third(user, event, ctx):
    """Every third event of a user: an alert."""
    n = (ctx.state(COUNT).read() or 0) + 1
    ctx.state(COUNT).write(n)
    return [{"user": user, "nth": n}] if n % 3 == 0 else []


pipeline = Pipeline(os.environ["SIB_PIPELINE"])
by_user = pipeline.read(
    "events",
    KafkaSource(os.environ["SIB_IN"], id=lambda e: e["event_id"], timestamp=lambda e: e["ts"]),
).key_by("by-user", lambda e: e["user"])
(
    by_user.process(os.environ.get("ALERT_STEP", "alert"), every_third, states=[COUNT]).write(
        "alerts-out", KafkaSink(os.environ["SIB_ALERTS"])
    )
)
(
    by_user.map_values("amount", lambda e: e["amount"])
    .combine_per_key("revenue", "sum")
    .write("revenue-out", KafkaSink(os.environ["SIB_OUT"]))
)
