"""Sources and sinks: how records enter and leave a pipeline."""

from __future__ import annotations

from connectors.base import SinkConnector, SinkWriter, SourceConnector, TaskInfo
from connectors.collect import Collect
from connectors.collections import Collection, Generate
from connectors.files import JsonLinesSink, JsonLinesSource, LineFiles, TextFile

__all__ = [
    "Collect",
    "Collection",
    "Generate",
    "JsonLinesSink",
    "JsonLinesSource",
    "LineFiles",
    "SinkConnector",
    "SinkWriter",
    "SourceConnector",
    "TaskInfo",
    "TextFile",
]
