"""A table copied through change data capture: PostgreSQL -> Debezium -> Kafka -> Onceflow.

changes (Kafka, Debezium's events read as Change records) -> by primary key -> the row, None
once deleted -> a PostgreSQL upsert (a None deletes the row) and a Kafka topic (a None is a
tombstone), and with ``CDC_ICEBERG`` (a folder) an Iceberg upsert too. Names come from the
environment (``CDC_PIPELINE``, ``CDC_IN``, ``CDC_OUT``, ``PG_TABLE``, ``PG_CONNINFO``; the
password in ``PGPASSWORD``).
"""

import os

from onceflow import KafkaSink, KafkaSource, Pipeline
from onceflow.connectors.postgres import PostgresSink

pipeline = Pipeline(os.environ["CDC_PIPELINE"])
rows = (
    pipeline.read("changes", KafkaSource(os.environ["CDC_IN"], format="debezium"))
    .key_by("by-id", lambda change: change.key_value)
    .map_values("row", lambda change: change.row)
)
rows.write(
    "table",
    PostgresSink(
        os.environ["PG_TABLE"],
        conninfo=os.environ["PG_CONNINFO"],
        mode="upsert",
        key_columns=["id"],
    ),
)
rows.write("topic", KafkaSink(os.environ["CDC_OUT"]))
if os.environ.get("CDC_ICEBERG"):  # and an Iceberg upsert (a SQL catalog in that folder)
    from onceflow.sinks import Iceberg

    folder = os.environ["CDC_ICEBERG"]
    os.makedirs(os.path.join(folder, "warehouse"), exist_ok=True)
    catalog = {
        "type": "sql",
        "uri": f"sqlite:///{os.path.join(folder, 'catalog.db')}",
        "warehouse": f"file://{os.path.join(folder, 'warehouse')}",
    }
    rows.write(
        "lake", Iceberg("onceflow.users", catalog=catalog, mode="upsert", key_columns=["id"])
    )
