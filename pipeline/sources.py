"""Sources a pipeline can read (re-exported from :mod:`connectors`): every source Onceflow has.

``Kafka`` and ``PostgresChanges`` are imported when first used (PEP 562): Kafka's codecs
(Avro, Protobuf) cost ~0.07 s that a pipeline without Kafka does not pay. ``Kafka`` is
``onceflow.KafkaSource`` under another name. ``FileStream`` is what ``JsonLines``,
``TextFile`` and ``Parquet`` make with ``watch=True``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from onceflow.connectors.collections import Collection, Generate
from onceflow.connectors.file_stream import FileStream
from onceflow.connectors.file_stream import ParquetSource as Parquet
from onceflow.connectors.files import Csv, LineFiles, TextFile
from onceflow.connectors.files import JsonLinesSource as JsonLines
from onceflow.kernel.lazy import exports

if TYPE_CHECKING:
    from onceflow.connectors.kafka.source import KafkaSource as Kafka
    from onceflow.connectors.postgres_changes import PostgresChanges

# name -> (the module that defines it, its name there), imported on first use
_LAZY = {
    "Kafka": ("onceflow.connectors.kafka.source", "KafkaSource"),
    "PostgresChanges": ("onceflow.connectors.postgres_changes", "PostgresChanges"),
}

__all__ = [
    "Collection",
    "Csv",
    "FileStream",
    "Generate",
    "JsonLines",
    "Kafka",
    "LineFiles",
    "Parquet",
    "PostgresChanges",
    "TextFile",
]


if not TYPE_CHECKING:  # mypy sees the names above
    __getattr__, __dir__ = exports(globals(), _LAZY)
