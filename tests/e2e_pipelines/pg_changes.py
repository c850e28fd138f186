"""A table copied from PostgreSQL's log directly (no Kafka in): a replication slot's changes.

changes (PostgresChanges of ``PG_SOURCE``) -> by primary key -> the row, None once deleted
-> a PostgreSQL upsert into ``PG_TABLE`` (a None deletes the row) and a Kafka topic
(``CDC_OUT``; a None is a tombstone); each change's operation and key to ``CDC_OPS`` (how
the test tells snapshot reads from changes). ``CDC_PIPELINE`` names the pipeline (and the slot);
the server is ``PG_CONNINFO``, the password in ``PGPASSWORD``.
"""

import os

from onceflow import KafkaSink, Pipeline, sinks, sources

pipeline = Pipeline(os.environ["CDC_PIPELINE"])
changes = sources.PostgresChanges(os.environ["PG_SOURCE"], conninfo=os.environ["PG_CONNINFO"])
stream = pipeline.read("changes", changes)
rows = stream.key_by("by-id", lambda change: change.key_value).map_values(
    "row", lambda change: change.row
)
rows.write(
    "table",
    sinks.Postgres(
        os.environ["PG_TABLE"],
        conninfo=os.environ["PG_CONNINFO"],
        mode="upsert",
        key_columns=["id"],
    ),
)
rows.write("topic", KafkaSink(os.environ["CDC_OUT"]))
summary = stream.map("op", lambda c: {"op": c.op, "id": c.key_value})
summary.write("ops", KafkaSink(os.environ["CDC_OPS"]))
