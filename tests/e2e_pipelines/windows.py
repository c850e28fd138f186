"""The pipeline the window tests run: per-user sums of ``v`` over event-time windows.

events (Kafka, IDs from event_id, event time from ts) -> by-user -> window -> total (sum)
  -> panes (Kafka sink: the sum as the value, window and pane in headers)

Everything comes from the environment so each test has its own: ``WIN_PIPELINE``,
``WIN_IN``, ``WIN_OUT``, ``WIN_KIND`` (``fixed:60s``, ``sliding:2m:1m``, ``sessions:30s``,
``global``), ``WIN_LATENESS`` (``0``, ``1m``), ``WIN_ACCUMULATION``, ``WIN_EARLY_EVERY``,
``WIN_EARLY_SECONDS``, ``WIN_LATE`` (``batch``, ``record``, ``none``), ``WIN_ON_TIME``
(``0`` for none) and ``WIN_OUT_OF_ORDER`` (the watermark's bounded out-of-orderness).
"""

import os

from onceflow import EventTime, KafkaSink, KafkaSource, Pipeline
from onceflow.windows import Fixed, Global, Sessions, Sliding, Trigger

env = os.environ
kind, *params = env.get("WIN_KIND", "fixed:60s").split(":")
windows = {
    "fixed": lambda: Fixed(params[0]),
    "sliding": lambda: Sliding(params[0], params[1]),
    "sessions": lambda: Sessions(params[0]),
    "global": Global,
}[kind]()
early_every = env.get("WIN_EARLY_EVERY")
early_seconds = env.get("WIN_EARLY_SECONDS")
trigger = Trigger(
    early_every=int(early_every) if early_every else None,
    early_seconds=float(early_seconds) if early_seconds else None,
    on_time=env.get("WIN_ON_TIME", "1") == "1",
    late=env.get("WIN_LATE", "batch"),
)
pipeline = Pipeline(
    env["WIN_PIPELINE"],
    event_time=EventTime.of(out_of_orderness=env.get("WIN_OUT_OF_ORDER", "30s")),
)
(
    pipeline.read(
        "events",
        KafkaSource(env["WIN_IN"], id=lambda e: e["event_id"], timestamp=lambda e: e["ts"]),
    )
    .key_by("by-user", lambda e: e["user"])
    .map_values("amount", lambda e: e["v"])
    .window(
        "window",
        windows,
        trigger=trigger,
        allowed_lateness=env.get("WIN_LATENESS", "0"),
        accumulation=env.get("WIN_ACCUMULATION", "accumulating"),
    )
    .combine_per_key("total", "sum")
    .write("panes", KafkaSink(env["WIN_OUT"]))
)
