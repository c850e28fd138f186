"""The README's example: ``onceflow explain examples/orders.py``.

``id`` names one *event* (an order placed, then paid, then shipped are three events of one
order, each with its own ``event_id``); an order's ID as ``id`` would drop every later event
of the same order as a copy (see docs/concepts/ids.md).
"""

from onceflow import DedupConfig, KafkaSink, KafkaSource, Pipeline

pipeline = Pipeline("orders", dedup=DedupConfig.of(horizon="24h", bucket="1h"))
orders = pipeline.read(
    "orders",
    KafkaSource("orders", id=lambda o: o["event_id"], timestamp=lambda o: o["ts"]),
)
orders.filter("paid", lambda o: o["status"] == "paid").write("paid-out", KafkaSink("paid-orders"))
(
    orders.key_by("by-customer", lambda o: o["customer"])
    .map_values("amount", lambda o: o["amount"])
    .combine_per_key("revenue", "sum")
    .write("revenue-out", KafkaSink("revenue-by-customer"))
)
