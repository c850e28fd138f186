"""Changes per key into a PostgreSQL table and a compacted Kafka topic, deletes included.

changes (Kafka, IDs from ``event_id``) -> by-user -> the row, or None for ``"op": "delete"``
-> a PostgreSQL upsert (``key_columns=["key"]``: a None deletes the user's row) and a Kafka
topic (a None is a tombstone). Names come from the environment (``CHG_PIPELINE``,
``CHG_IN``, ``CHG_OUT``, ``PG_TABLE``, ``PG_CONNINFO``; the password in ``PGPASSWORD``);
with ``CHG_ICEBERG`` (a folder) also an Iceberg upsert of onceflow.users in a SQL catalog
there.
"""

import os

from onceflow import KafkaSink, KafkaSource, Pipeline
from onceflow.connectors.postgres import PostgresSink

pipeline = Pipeline(os.environ["CHG_PIPELINE"])
rows = (
    pipeline.read(
        "changes",
        KafkaSource(os.environ["CHG_IN"], id=lambda e: e["event_id"], timestamp=lambda e: e["ts"]),
    )
    .key_by("by-user", lambda e: e["user"])
    .map_values("row", lambda e: None if e["op"] == "delete" else {"total": e["total"]})
)
rows.write(
    "table",
    PostgresSink(
        os.environ["PG_TABLE"],
        conninfo=os.environ["PG_CONNINFO"],
        mode="upsert",
        key_columns=["key"],
    ),
)
rows.write("topic", KafkaSink(os.environ["CHG_OUT"]))
if os.environ.get("CHG_ICEBERG"):  # the same rows upserted into an Iceberg table too
    from onceflow.sinks import Iceberg

    folder = os.environ["CHG_ICEBERG"]  # the test opens the same catalog to read the table
    os.makedirs(os.path.join(folder, "warehouse"), exist_ok=True)
    catalog = {
        "type": "sql",
        "uri": f"sqlite:///{os.path.join(folder, 'catalog.db')}",
        "warehouse": f"file://{os.path.join(folder, 'warehouse')}",
    }
    rows.write(
        "lake", Iceberg("onceflow.users", catalog=catalog, mode="upsert", key_columns=["key"])
    )
