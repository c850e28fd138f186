"""The file sinks' crash tests run this: events -> a non-deterministic map -> files.

events (Kafka, IDs from the event_id field) -> enrich (adds random noise) -> files (Parquet,
one folder per user; JSON lines with ``FILES_FORMAT=jsonl``; with ``FILES_FORMAT=postgres``
rows of the table ``PG_TABLE`` at ``PG_CONNINFO``, the password in ``PGPASSWORD``; with
``FILES_FORMAT=iceberg`` the Iceberg table ``onceflow.orders`` of a SQL catalog on SQLite
under the folder, see :func:`iceberg_catalog`). Topics,
the pipeline name and the folder come from the environment (``ORDERS_PIPELINE``,
``ORDERS_IN``, ``PARQUET_OUT``).
"""

import os
import random

from onceflow import KafkaSource, Pipeline
from onceflow.connectors.postgres import PostgresSink
from onceflow.sinks import Iceberg, JsonLines, Parquet

ICEBERG_TABLE = "onceflow.orders"


def iceberg_catalog(folder):
    """The properties of the SQL catalog (SQLite) and warehouse the Iceberg variant writes."""
    os.makedirs(os.path.join(folder, "warehouse"), exist_ok=True)
    return {
        "type": "sql",
        "uri": f"sqlite:///{os.path.join(folder, 'catalog.db')}",
        "warehouse": f"file://{os.path.join(folder, 'warehouse')}",
    }


def _sink():
    fmt = os.environ.get("FILES_FORMAT", "parquet")
    if fmt == "jsonl":
        return JsonLines(os.environ["PARQUET_OUT"])
    if fmt == "iceberg":
        return Iceberg(ICEBERG_TABLE, catalog=iceberg_catalog(os.environ["PARQUET_OUT"]))
    if fmt == "postgres":
        return PostgresSink(os.environ["PG_TABLE"], conninfo=os.environ["PG_CONNINFO"])
    return Parquet(os.environ["PARQUET_OUT"], partition_by=["user"], row_group_size=500)


pipeline = Pipeline(os.environ["ORDERS_PIPELINE"])
pipeline.read(
    "events",
    KafkaSource(os.environ["ORDERS_IN"], id=lambda e: e["event_id"], timestamp=lambda e: e["ts"]),
).map("enrich", lambda e: {**e, "noise": random.random()}).write("files", _sink())
