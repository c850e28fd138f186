"""Sources and sinks: how records enter and leave a pipeline.

The names below are imported when first used (PEP 562): a Python interpreter that needs
one module of a subpackage (Spark's planner processes unpickling the Kafka data source, see
:mod:`onceflow`) does not import every connector with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from onceflow.kernel.lazy import exports

if TYPE_CHECKING:
    from onceflow.connectors.base import SinkConnector, SinkWriter, SourceConnector, TaskInfo
    from onceflow.connectors.collect import Collect
    from onceflow.connectors.collections import Collection, Generate
    from onceflow.connectors.file_stream import FileStream, ParquetSource
    from onceflow.connectors.files import JsonLinesSink, JsonLinesSource, LineFiles, TextFile
    from onceflow.connectors.iceberg import IcebergSink
    from onceflow.connectors.parquet import ParquetSink

# name -> the module that defines it
_EXPORTS = {
    "SinkConnector": "onceflow.connectors.base",
    "SinkWriter": "onceflow.connectors.base",
    "SourceConnector": "onceflow.connectors.base",
    "TaskInfo": "onceflow.connectors.base",
    "Collect": "onceflow.connectors.collect",
    "Collection": "onceflow.connectors.collections",
    "Generate": "onceflow.connectors.collections",
    "FileStream": "onceflow.connectors.file_stream",
    "ParquetSource": "onceflow.connectors.file_stream",
    "JsonLinesSink": "onceflow.connectors.files",
    "JsonLinesSource": "onceflow.connectors.files",
    "LineFiles": "onceflow.connectors.files",
    "TextFile": "onceflow.connectors.files",
    "IcebergSink": "onceflow.connectors.iceberg",
    "ParquetSink": "onceflow.connectors.parquet",
}


if not TYPE_CHECKING:  # mypy sees the names above, and flags a misspelt one
    __getattr__, __dir__ = exports(globals(), _EXPORTS)

__all__ = [
    "Collect",
    "Collection",
    "FileStream",
    "Generate",
    "IcebergSink",
    "JsonLinesSink",
    "JsonLinesSource",
    "LineFiles",
    "ParquetSink",
    "ParquetSource",
    "SinkConnector",
    "SinkWriter",
    "SourceConnector",
    "TaskInfo",
    "TextFile",
]
