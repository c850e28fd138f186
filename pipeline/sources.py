"""Sources a pipeline can read (re-exported from :mod:`connectors`)."""

from __future__ import annotations

from onceflow.connectors.collections import Collection, Generate
from onceflow.connectors.file_stream import ParquetSource as Parquet
from onceflow.connectors.files import JsonLinesSource as JsonLines
from onceflow.connectors.files import LineFiles, TextFile

__all__ = ["Collection", "Generate", "JsonLines", "LineFiles", "Parquet", "TextFile"]
