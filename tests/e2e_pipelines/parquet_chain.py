"""A pipeline downstream of another's Parquet files: events per user, from a watched folder.

files (``ParquetSource(..., watch=True)``: the upstream sink's folder, its ``user=...``
sub-folders and the IDs its rows carry) -> by-user -> count -> a Kafka sink. The folder,
output topic and pipeline name come from the environment (``CHAIN_IN``, ``CHAIN_OUT``,
``CHAIN_PIPELINE``); ``CHAIN_FILES_PER_BATCH`` caps the files per micro-batch.
"""

import os

from onceflow import KafkaSink, Pipeline
from onceflow.connectors.file_stream import ParquetSource

per_batch = os.environ.get("CHAIN_FILES_PER_BATCH")
pipeline = Pipeline(os.environ["CHAIN_PIPELINE"])
(
    pipeline.read(
        "files",
        ParquetSource(
            os.environ["CHAIN_IN"],
            watch=True,
            timestamp=lambda row: row["ts"],
            max_files_per_batch=int(per_batch) if per_batch else None,
        ),
    )
    .key_by("by-user", lambda row: row["user"])
    .combine_per_key("events", "count")
    .write("counts", KafkaSink(os.environ["CHAIN_OUT"]))
)
