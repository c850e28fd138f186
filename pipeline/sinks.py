"""Sinks a pipeline can write (re-exported from :mod:`connectors`)."""

from __future__ import annotations

from onceflow.connectors.collect import Collect
from onceflow.connectors.files import JsonLinesSink as JsonLines
from onceflow.connectors.iceberg import IcebergSink as Iceberg
from onceflow.connectors.parquet import ParquetSink as Parquet

__all__ = ["Collect", "Iceberg", "JsonLines", "Parquet"]
