"""A watched landing folder: new JSON-lines files summed per user into Kafka.

landing (``JsonLinesSource(..., watch=True)``: IDs from each file and line, or from the
``event_id`` field with ``LANDING_IDS=field``) -> by-user -> total amount per user (a Kafka
sink). The folder, output topic and pipeline name come from the environment
(``LANDING_DIR``, ``LANDING_OUT``, ``LANDING_PIPELINE``); ``LANDING_FILES_PER_BATCH`` caps
the files per micro-batch; ``LANDING_FORMAT=csv`` reads CSV files (a header, quoted fields)
instead.
"""

import os

from onceflow import KafkaSink, Pipeline, sources
from onceflow.connectors.files import JsonLinesSource

per_batch = os.environ.get("LANDING_FILES_PER_BATCH")
by_field = os.environ.get("LANDING_IDS") == "field"
kind = sources.Csv if os.environ.get("LANDING_FORMAT") == "csv" else JsonLinesSource
pipeline = Pipeline(os.environ["LANDING_PIPELINE"])
(
    pipeline.read(
        "landing",
        kind(
            os.environ["LANDING_DIR"],
            watch=True,
            id=(lambda e: e["event_id"]) if by_field else None,
            timestamp=lambda e: int(e["ts"]),
            max_files_per_batch=int(per_batch) if per_batch else None,
        ),
    )
    .key_by("by-user", lambda e: e["user"])
    .map_values("amount", lambda e: int(e["amount"]))
    .combine_per_key("total", "sum")
    .write("totals", KafkaSink(os.environ["LANDING_OUT"]))
)
