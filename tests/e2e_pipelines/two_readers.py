"""A stage read by two others (issue 37, R1): ``orders`` feeds a keyed count and a merge.

orders (Kafka) -> order-copy (Kafka sink)
               -> order-user -> orders-per-user (keyed count) -> order-counts (Kafka sink)
payments (Kafka) ----+
orders --------------+-> merge "all" -> by-user -> events-per-user (keyed count)
                                                -> all-counts (Kafka sink)

``orders`` is read by an exchange (keyed) and by the merge (unkeyed, after ``payments`` in its
union): Spark persists it and computes it in whichever reader's task needs it first, so its
partition must be its own, not the reader's (:mod:`onceflow.runtime.driver.compile`). Topics and the
pipeline name come from the environment (``TWO_READERS_*``); ``TWO_READERS_IDS=position``
drops the id functions (each record is known by its position: copies sent upstream count
twice); ``TWO_READERS_SLOW_MS`` makes reading an order take that long (batches long enough to
kill a worker in).
"""

import os
import time

from onceflow import KafkaSink, KafkaSource, Pipeline

env = os.environ
by_position = env.get("TWO_READERS_IDS") == "position"
slow_s = float(env.get("TWO_READERS_SLOW_MS", "0")) / 1000


def event_id(e):
    return e["event_id"]


def user(e):
    return e["user"]


def slowly(e):
    if slow_s:
        time.sleep(slow_s)
    return e


def source(topic):
    return KafkaSource(topic, id=None if by_position else event_id, timestamp=lambda e: e["ts"])


pipeline = Pipeline(env["TWO_READERS_PIPELINE"])
orders = pipeline.read("orders", source(env["TWO_READERS_ORDERS"])).map("read", slowly)
payments = pipeline.read("payments", source(env["TWO_READERS_PAYMENTS"]))
orders.write("order-copy", KafkaSink(env["TWO_READERS_ORDER_COPY"]))
(
    orders.key_by("order-user", user)
    .count_per_key("orders-per-user")
    .write("order-counts", KafkaSink(env["TWO_READERS_ORDER_COUNTS"]))
)
(
    pipeline.merge("all", payments, orders)
    .key_by("by-user", user)
    .count_per_key("events-per-user")
    .write("all-counts", KafkaSink(env["TWO_READERS_ALL_COUNTS"]))
)
