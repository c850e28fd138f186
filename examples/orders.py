"""The README's example: ``onceflow explain examples/orders.py``."""

from onceflow import DedupConfig, KafkaSink, KafkaSource, Pipeline

pipeline = Pipeline("orders", dedup=DedupConfig.of(horizon="24h", bucket="1h"))
orders = pipeline.read(
    "orders",
    KafkaSource("orders", id=lambda o: o["order_id"], timestamp=lambda o: o["ts"]),
)
orders.filter("paid", lambda o: o["status"] == "paid").write("paid-out", KafkaSink("paid-orders"))
(
    orders.key_by("by-customer", lambda o: o["customer"])
    .map_values("amount", lambda o: o["amount"])
    .combine_per_key("revenue", "sum")
    .write("revenue-out", KafkaSink("revenue-by-customer"))
)
