"""Sources and sinks: how records enter and leave a pipeline."""

from __future__ import annotations

from onceflow.connectors.base import SinkConnector, SinkWriter, SourceConnector, TaskInfo
from onceflow.connectors.collect import Collect
from onceflow.connectors.collections import Collection, Generate
from onceflow.connectors.files import JsonLinesSink, JsonLinesSource, LineFiles, TextFile
from onceflow.connectors.iceberg import IcebergSink
from onceflow.connectors.parquet import ParquetSink

__all__ = [
    "Collect",
    "Collection",
    "Generate",
    "IcebergSink",
    "JsonLinesSink",
    "JsonLinesSource",
    "LineFiles",
    "ParquetSink",
    "SinkConnector",
    "SinkWriter",
    "SourceConnector",
    "TaskInfo",
    "TextFile",
]
