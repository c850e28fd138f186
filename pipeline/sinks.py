"""Sinks a pipeline can write (re-exported from :mod:`connectors`): every sink Onceflow has.

The Kafka sinks are imported when first used (PEP 562): their codecs (Avro, Protobuf) cost
~0.07 s that a pipeline without Kafka does not pay. ``Kafka`` is ``onceflow.KafkaSink`` under
another name; ``KafkaDeadLetters`` is the sink for ``Pipeline(dead_letters=...)`` whose topic
``onceflow dead-letters replay`` reads back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from onceflow.connectors.collect import Collect
from onceflow.connectors.files import JsonLinesSink as JsonLines
from onceflow.connectors.iceberg import IcebergSink as Iceberg
from onceflow.connectors.parquet import ParquetSink as Parquet
from onceflow.connectors.postgres import PostgresSink as Postgres
from onceflow.kernel.lazy import exports

if TYPE_CHECKING:
    from onceflow.connectors.kafka.dead_letters import KafkaDeadLetterSink as KafkaDeadLetters
    from onceflow.connectors.kafka.sink import KafkaSink as Kafka

# name -> (the module that defines it, its name there), imported on first use
_LAZY = {
    "Kafka": ("onceflow.connectors.kafka.sink", "KafkaSink"),
    "KafkaDeadLetters": ("onceflow.connectors.kafka.dead_letters", "KafkaDeadLetterSink"),
}

__all__ = ["Collect", "Iceberg", "JsonLines", "Kafka", "KafkaDeadLetters", "Parquet", "Postgres"]


if not TYPE_CHECKING:  # mypy sees the names above
    __getattr__, __dir__ = exports(globals(), _LAZY)
