"""Sources and sinks: how records enter and leave a pipeline.

The names below are imported when first used (PEP 562): a Python interpreter that needs
one module of a subpackage (Spark's planner processes unpickling the Kafka data source, see
:mod:`onceflow`) does not import every connector with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from onceflow.connectors.base import SinkConnector, SinkWriter, SourceConnector, TaskInfo
    from onceflow.connectors.collect import Collect
    from onceflow.connectors.collections import Collection, Generate
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
    "JsonLinesSink": "onceflow.connectors.files",
    "JsonLinesSource": "onceflow.connectors.files",
    "LineFiles": "onceflow.connectors.files",
    "TextFile": "onceflow.connectors.files",
    "IcebergSink": "onceflow.connectors.iceberg",
    "ParquetSink": "onceflow.connectors.parquet",
}


if not TYPE_CHECKING:  # mypy sees the names above, and flags a misspelt one

    def __getattr__(name: str) -> Any:
        """An exported name, imported on first use (then kept in the package's namespace)."""
        if name not in _EXPORTS:
            msg = f"module {__name__!r} has no attribute {name!r}"
            raise AttributeError(msg)
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    """The package's names, the ones not imported yet among them."""
    return sorted(set(globals()) | set(__all__))


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
