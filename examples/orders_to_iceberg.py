"""Paid orders into an Apache Iceberg table, exactly once.

    onceflow run examples/orders_to_iceberg.py

The catalog is pyiceberg's SQL catalog on a SQLite file with a local warehouse folder (under
``ICEBERG_HOME``, default ``/tmp/onceflow-iceberg``); pass any pyiceberg catalog's properties
instead (REST, Glue, Hive ...), credentials included: they are never printed. The table
``shop.paid_orders`` is created on first write from the rows' types, partitioned by country.
Read it with anything that reads Iceberg: ``load_catalog("default", **CATALOG)
.load_table("shop.paid_orders").scan().to_pandas()``, Spark, Trino, DuckDB.
"""

import os

from onceflow import KafkaSource, Pipeline
from onceflow.sinks import Iceberg

HOME = os.environ.get("ICEBERG_HOME", "/tmp/onceflow-iceberg")  # noqa: S108 - a demo's folder
os.makedirs(os.path.join(HOME, "warehouse"), exist_ok=True)
# --8<-- [start:sink]
CATALOG = {
    "type": "sql",
    "uri": f"sqlite:///{HOME}/catalog.db",
    "warehouse": f"file://{HOME}/warehouse",
}
pipeline = Pipeline("orders-to-iceberg")
(
    pipeline.read(
        "orders",
        KafkaSource("orders", id=lambda o: o["event_id"], timestamp=lambda o: o["ts"]),
    )
    .filter("paid", lambda o: o["status"] == "paid")
    .write("lake", Iceberg("shop.paid_orders", catalog=CATALOG, partition_by=["country"]))
)
# --8<-- [end:sink]
