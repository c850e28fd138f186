"""Sources a pipeline can read (re-exported from :mod:`connectors`): every source Onceflow has.

``Kafka`` and ``PostgresChanges`` are imported when first used (PEP 562): Kafka's codecs
(Avro, Protobuf) cost ~0.07 s that a pipeline without Kafka does not pay. ``Kafka`` is
``onceflow.KafkaSource`` under another name. ``FileStream`` is what ``JsonLines``,
``TextFile`` and ``Parquet`` make with ``watch=True``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from onceflow.connectors.collections import Collection, Generate
from onceflow.connectors.file_stream import FileStream
from onceflow.connectors.file_stream import ParquetSource as Parquet
from onceflow.connectors.files import Csv, LineFiles, TextFile
from onceflow.connectors.files import JsonLinesSource as JsonLines

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


def __getattr__(name: str) -> Any:
    """The Kafka and PostgreSQL change sources, imported on first use (see the docstring)."""
    if name not in _LAZY:
        msg = f"module {__name__!r} has no attribute {name!r}"
        raise AttributeError(msg)
    module, defined = _LAZY[name]
    value = getattr(importlib.import_module(module), defined)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """Every name, the lazy ones included (a notebook's completion lists them)."""
    return sorted(set(globals()) | set(__all__))
