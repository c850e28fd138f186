"""Changes per key into an Iceberg table, deletes included (``IcebergSink(mode="upsert")``).

changes (Kafka, IDs from ``event_id``) -> by-user -> the row, or None for ``"op": "delete"``
-> an Iceberg upsert (``key_columns=["key"]``: a None deletes the user's row) of the table
onceflow.users in a SQL catalog (SQLite) and warehouse in the folder ``CHG_ICEBERG``. Names
come from the environment (``CHG_PIPELINE``, ``CHG_IN``, ``CHG_ICEBERG``).
"""

import os

from onceflow import KafkaSource, Pipeline
from onceflow.sinks import Iceberg

folder = os.environ["CHG_ICEBERG"]  # the test opens the same catalog to read the table
os.makedirs(os.path.join(folder, "warehouse"), exist_ok=True)
catalog = {
    "type": "sql",
    "uri": f"sqlite:///{os.path.join(folder, 'catalog.db')}",
    "warehouse": f"file://{os.path.join(folder, 'warehouse')}",
}
pipeline = Pipeline(os.environ["CHG_PIPELINE"])
rows = (
    pipeline.read(
        "changes",
        KafkaSource(os.environ["CHG_IN"], id=lambda e: e["event_id"], timestamp=lambda e: e["ts"]),
    )
    .key_by("by-user", lambda e: e["user"])
    .map_values("row", lambda e: None if e["op"] == "delete" else {"total": e["total"]})
)
rows.write("table", Iceberg("onceflow.users", catalog=catalog, mode="upsert", key_columns=["key"]))
